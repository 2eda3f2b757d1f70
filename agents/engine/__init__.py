"""Inference engines behind one protocol: the embedded torch engine and the SGLang HTTP client."""

from agents.engine.embedded import ContextOverflowError, EmbeddedEngine, EmbeddedEngineConfig
from agents.engine.protocol import Engine, EngineWithRoutesStart, FinishReason, Generation, SamplingParams
from agents.engine.sglang import SGLangEngine, SGLangOptions, SGLangUnavailable, launch_command

__all__ = [
    "ContextOverflowError",
    "EmbeddedEngine",
    "EmbeddedEngineConfig",
    "Engine",
    "EngineWithRoutesStart",
    "FinishReason",
    "Generation",
    "SGLangEngine",
    "SGLangOptions",
    "SGLangUnavailable",
    "SamplingParams",
    "launch_command",
]
