"""Calibration algorithms, applied to one decoder layer at a time, one registry of them.

Each algorithm lives in its own module and registers its options model and its layer function there
(`registry.register`):

  transforms  SmoothQuant (`smoothquant.py`) and AWQ (`awq.py`) rescale (and AWQ clips) weights in place; the
              layer computes the same function (up to AWQ's clipping) with easier-to-quantize tensors;
  quantizers  RTN (`rtn.py`) and GPTQ (`gptq.py`) turn each Linear's weight into codes and scales.

A scheme composes them, transform first ("smoothquant+gptq"); `AlgorithmSteps.of(scheme)` (`steps.py`) is the
resolved view the layer stream and the build ask everything about the scheme's algorithm.

Consumers import `llmc.quant.algorithms.catalog`: it imports every built-in algorithm module and re-exports the
registry's lookups and `AlgorithmSteps`. This file imports nothing, so an algorithm module (which imports
`llmc.quant.algorithms.registry`, and so this package) is never imported by the package it belongs to.
"""
