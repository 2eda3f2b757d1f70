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
