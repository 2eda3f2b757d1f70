"""The rollout side: inference engines, the trajectory record, and (next) the multi-turn rollout driver.

This package imports only `envs` (and through it `sandbox`) from the project.
"""

from agents.engine import (
    ContextOverflowError,
    EmbeddedEngine,
    EmbeddedEngineConfig,
    Engine,
    FinishReason,
    Generation,
    SamplingParams,
)
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

__all__ = [
    "FAMILIES",
    "ContextOverflowError",
    "EmbeddedEngine",
    "EmbeddedEngineConfig",
    "Engine",
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
    "TinyMoEConfig",
    "Trajectory",
    "build_tiny_moe",
    "default_corpus",
    "index_dtype",
    "load_jsonl",
    "load_model",
    "moe_info",
    "parameter_count",
    "save_jsonl",
    "save_model",
    "tiny_tokenizer",
    "train_tokenizer",
]
