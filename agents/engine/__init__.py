"""Inference engines behind one protocol: the embedded torch engine and (next) the SGLang client."""

from agents.engine.embedded import ContextOverflowError, EmbeddedEngine, EmbeddedEngineConfig
from agents.engine.protocol import Engine, FinishReason, Generation, SamplingParams

__all__ = [
    "ContextOverflowError",
    "EmbeddedEngine",
    "EmbeddedEngineConfig",
    "Engine",
    "FinishReason",
    "Generation",
    "SamplingParams",
]
