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
from agents.routing import RoutedExperts, index_dtype
from agents.trajectory import Origin, Segment, Status, Trajectory, load_jsonl, save_jsonl

__all__ = [
    "ContextOverflowError",
    "EmbeddedEngine",
    "EmbeddedEngineConfig",
    "Engine",
    "FinishReason",
    "Generation",
    "Origin",
    "RoutedExperts",
    "SamplingParams",
    "Segment",
    "Status",
    "Trajectory",
    "index_dtype",
    "load_jsonl",
    "save_jsonl",
]
