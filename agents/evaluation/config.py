"""How a model is evaluated (`EvalConfig`): samples per task, sampling, token budgets, what counts as
correct, and how the episodes map onto the rollout driver's config."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pacerl.agents.engine.protocol import SamplingParams
from pacerl.agents.rollout import RolloutConfig


@dataclass(frozen=True)
class EvalConfig:
    """How a model is evaluated; the defaults sample as `pacerl train` does by default."""

    samples: int = 4
    """K: episodes sampled per task."""
    temperature: float = 0.7
    """Sampling temperature of every turn; 0 is greedy, and then `samples` must be 1."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1] (evaluation may truncate the distribution; training may not)."""
    top_k: int = 0
    """Sample among the k most likely tokens only; 0 keeps all."""
    max_new_tokens: int = 40
    """Tokens generated per assistant turn at most."""
    max_total_tokens: int = 256
    """Context budget of a whole episode (prompt, generations and tool responses)."""
    ks: tuple[int, ...] = (1,)
    """The k of each pass@k reported, each in 1..samples; k = samples is always reported too (`all_ks`)."""
    success_threshold: float = 1.0
    """An episode whose reward reaches this is correct (a failed episode, without reward, never is)."""
    max_tasks: int | None = None
    """Evaluate only the first this many tasks; None: all of them."""
    tool_schemas_in_prompt: bool = False
    """Render the env's tool schemas into the system turn (off, as in training, for a model that learned
    its tools by SFT)."""
    seed: int = 0
    """Seed of the engine's samplers where the caller builds the engine from this config (`pacerl eval`);
    an engine handed to `evaluate` keeps its own."""
    stop_strings: tuple[str, ...] = ("</tool_call>",)
    """Text that ends an assistant turn early, so the tool call it closes runs at once."""
    max_concurrent_tasks: int = 16
    """Tasks whose samples are played at once; the others wait. Every episode may hold a sandboxed
    interpreter, so this bounds the sandboxes alive as well as the engine's batch."""

    def __post_init__(self) -> None:
        problems = []
        if self.samples < 1:
            problems.append(f"samples must be >= 1, got {self.samples}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            problems.append(f"temperature must be finite and >= 0, got {self.temperature}")
        elif self.temperature == 0 and self.samples != 1:
            problems.append(
                f"temperature 0 is greedy: every sample would be the same; use samples=1, got {self.samples}"
            )
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            problems.append(f"top_p must be in (0, 1] and top_k >= 0, got {self.top_p} and {self.top_k}")
        if self.max_new_tokens < 1 or self.max_total_tokens < 2:
            problems.append("max_new_tokens must be >= 1 and max_total_tokens >= 2")
        if any(not 1 <= k <= self.samples for k in self.ks):
            problems.append(f"every k of ks must be in 1..samples ({self.samples}), got {self.ks}")
        if not math.isfinite(self.success_threshold):
            problems.append(f"success_threshold must be finite, got {self.success_threshold}")
        if self.max_tasks is not None and self.max_tasks < 1:
            problems.append(f"max_tasks must be >= 1 or None, got {self.max_tasks}")
        if self.max_concurrent_tasks < 1:
            problems.append(f"max_concurrent_tasks must be >= 1, got {self.max_concurrent_tasks}")
        if problems:
            raise ValueError("invalid eval config: " + "; ".join(problems))

    @property
    def all_ks(self) -> tuple[int, ...]:
        """The k of every pass@k reported: `ks` and `samples`, ascending. (`ks` itself stays as given, so
        that `dataclasses.replace(config, samples=...)` and a saved config read back behave alike.)"""
        return tuple(sorted({*self.ks, self.samples}))

    def rollout_config(self) -> RolloutConfig:
        """The driver's config: K samples per task as one group, failed episodes kept (they count as
        incorrect; dropping their group would flatter the model), no routes (nothing trains on them)."""
        sampling = SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop_strings=self.stop_strings,
        )
        return RolloutConfig(
            group_size=self.samples,
            sampling=sampling,
            max_total_tokens=self.max_total_tokens,
            on_failure="keep",
            record_routes=False,
            tool_schemas_in_prompt=self.tool_schemas_in_prompt,
        )
