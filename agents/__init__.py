"""The rollout side: inference engines, the trajectory record, and (next) the multi-turn rollout driver.

This package imports only `envs` (and through it `sandbox`) from the project.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agents.engine import (
        ContextOverflowError,
        EmbeddedEngine,
        EmbeddedEngineConfig,
        Engine,
        FinishReason,
        Generation,
        SamplingParams,
    )
    from agents.evaluation import EvalConfig, EvalReport, TaskResult, avg_at_k, evaluate, pass_at_k
    from agents.models import (
        FAMILIES,
        MoEInfo,
        TinyMoEConfig,
        build_tiny_moe,
        load_model,
        moe_info,
        parameter_count,
        save_model,
    )
    from agents.rollout import RolloutConfig, RolloutDriver
    from agents.routing import RoutedExperts, index_dtype
    from agents.tokenizer import default_corpus, tiny_tokenizer, train_tokenizer
    from agents.trajectory import Origin, Segment, Status, Trajectory, load_jsonl, save_jsonl

_SOURCES = {
    "ContextOverflowError": "agents.engine",
    "EmbeddedEngine": "agents.engine",
    "EmbeddedEngineConfig": "agents.engine",
    "Engine": "agents.engine",
    "FinishReason": "agents.engine",
    "Generation": "agents.engine",
    "SamplingParams": "agents.engine",
    "EvalConfig": "agents.evaluation",
    "EvalReport": "agents.evaluation",
    "TaskResult": "agents.evaluation",
    "avg_at_k": "agents.evaluation",
    "evaluate": "agents.evaluation",
    "pass_at_k": "agents.evaluation",
    "FAMILIES": "agents.models",
    "MoEInfo": "agents.models",
    "TinyMoEConfig": "agents.models",
    "build_tiny_moe": "agents.models",
    "load_model": "agents.models",
    "moe_info": "agents.models",
    "parameter_count": "agents.models",
    "save_model": "agents.models",
    "RolloutConfig": "agents.rollout",
    "RolloutDriver": "agents.rollout",
    "RoutedExperts": "agents.routing",
    "index_dtype": "agents.routing",
    "default_corpus": "agents.tokenizer",
    "tiny_tokenizer": "agents.tokenizer",
    "train_tokenizer": "agents.tokenizer",
    "Origin": "agents.trajectory",
    "Segment": "agents.trajectory",
    "Status": "agents.trajectory",
    "Trajectory": "agents.trajectory",
    "load_jsonl": "agents.trajectory",
    "save_jsonl": "agents.trajectory",
}
"""Where each name this package re-exports lives: loaded on first use, so that importing one
light module of the package (the simulator does) does not load torch with the rest."""


def __getattr__(name: str) -> object:
    if name not in _SOURCES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_SOURCES[name]), name)


__all__ = [
    "FAMILIES",
    "ContextOverflowError",
    "EmbeddedEngine",
    "EmbeddedEngineConfig",
    "Engine",
    "EvalConfig",
    "EvalReport",
    "FinishReason",
    "Generation",
    "MoEInfo",
    "Origin",
    "RolloutConfig",
    "RolloutDriver",
    "RoutedExperts",
    "SamplingParams",
    "Segment",
    "Status",
    "TaskResult",
    "TinyMoEConfig",
    "Trajectory",
    "avg_at_k",
    "build_tiny_moe",
    "default_corpus",
    "evaluate",
    "index_dtype",
    "load_jsonl",
    "load_model",
    "moe_info",
    "parameter_count",
    "pass_at_k",
    "save_jsonl",
    "save_model",
    "tiny_tokenizer",
    "train_tokenizer",
]
