"""Runtime targets: one module per runtime family beside this file registers its runtimes (their capability rules
as data, with their sources; their known releases; the artifact format each reads) into `registry`. The formats
themselves (exporter, stage-key options, cost, Triton backend, what `llmc inspect` recognises, which engines load
them) are classes in `llmc.formats`, which each runtime module imports.

Consumers import `llmc.runtimes.catalog`: it imports every built-in runtime module, in the order of
docs/compatibility.md, and re-exports the lookups. This file imports nothing, so a runtime module (which imports
`llmc.runtimes.registry`, and so this package) is never imported by the package it belongs to: no import cycle.
"""
