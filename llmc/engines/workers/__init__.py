"""Scripts that run inside the out-of-process engines' own environments, where llmc is not installed.

Each is started as `<engine python> <worker>.py <request folder>` (llmc.engines.runner). Python puts a
script's folder first on sys.path, so this folder holds nothing but the workers and their wire helpers:
next to llmc/engines/tensorrt.py, `import tensorrt` inside TensorRT-LLM would load llmc's module instead.
"""
