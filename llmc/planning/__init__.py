"""The plan of a build before any weight loads: checks (plan), the cost arithmetic (resources), tensor shapes from headers (shapes), data-parallel scaling (scaling)."""
