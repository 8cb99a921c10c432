"""Evaluation engines: the registry by name (llmc.engines.registry) is the public API; the engine modules
are imported only when an engine is opened."""

from llmc.engines.registry import ENGINE_NAMES, Engine, EngineSpec, engine_spec, open_engine

__all__ = ["ENGINE_NAMES", "Engine", "EngineSpec", "engine_spec", "open_engine"]
