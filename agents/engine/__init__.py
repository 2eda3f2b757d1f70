"""Inference engines behind one protocol: the embedded torch engine and the SGLang HTTP client."""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agents.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
    from agents.engine.protocol import (
        ContextOverflowError,
        Engine,
        EngineWithRoutesStart,
        FinishReason,
        Generation,
        SamplingParams,
    )
    from agents.engine.sglang import SGLangEngine, SGLangOptions, SGLangUnavailable, launch_command

_SOURCES = {
    "ContextOverflowError": "agents.engine.protocol",
    "EmbeddedEngine": "agents.engine.embedded",
    "EmbeddedEngineConfig": "agents.engine.embedded",
    "Engine": "agents.engine.protocol",
    "EngineWithRoutesStart": "agents.engine.protocol",
    "FinishReason": "agents.engine.protocol",
    "Generation": "agents.engine.protocol",
    "SamplingParams": "agents.engine.protocol",
    "SGLangEngine": "agents.engine.sglang",
    "SGLangOptions": "agents.engine.sglang",
    "SGLangUnavailable": "agents.engine.sglang",
    "launch_command": "agents.engine.sglang",
}
"""Where each name this package re-exports lives: loaded on first use, so that importing one
light module of the package (the simulator does) does not load torch with the rest."""


def __getattr__(name: str) -> object:
    if name not in _SOURCES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_SOURCES[name]), name)


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
