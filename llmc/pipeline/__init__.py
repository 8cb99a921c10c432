"""The build as a list of stage objects (`llmc.pipeline.stages`): `llmc plan` walks it summing costs, `llmc build`
walks it running each stage through one runner (`llmc.pipeline.runner`) that owns the cache protocol; torchrun's
share of the work is `llmc.pipeline.ranks`. docs/architecture.md follows the data through them."""
