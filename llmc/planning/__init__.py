"""The plan of a build before any weight loads: checks and the plan walk (plan), this machine and its probes
(machine; their cached, repeated measurements: probes), the plan's row type (rows), tensor shapes from headers (shapes), data-parallel scaling (scaling). Each
stage's cost model lives with the stage (llmc/pipeline/<stage>.py)."""
