"""llmc: quantize a Hugging Face causal LM into runtime-ready, evaluated, gated artifacts."""

__version__ = "0.1.0"
