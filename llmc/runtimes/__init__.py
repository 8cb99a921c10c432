"""Runtime targets: one module per runtime family beside this file registers the runtime and the artifact format
it reads (the exporter, its stage-key options, its capability rules as data, its Triton backend, what
`llmc inspect` recognises, which engines load it) into `registry`.

Consumers import `llmc.runtimes.catalog`: it imports every built-in runtime module, in the order of
docs/compatibility.md, and re-exports the lookups. This file imports nothing, so a runtime module (which imports
`llmc.runtimes.registry`, and so this package) is never imported by the package it belongs to: no import cycle.
"""
