"""The inference-engine protocol shared by the embedded engine and the SGLang client.

A generation returns, next to its tokens and behaviour log-probs, the policy version of every token:
when new weights arrive mid-generation the engine either finishes the request under them (embedded)
or aborts it (SGLang), and the rollout driver turns each run of one version into its own segment.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch


class ContextOverflowError(ValueError):
    """The prompt does not fit the engine's context (the driver ends such a trajectory `truncated`)."""


class FinishReason(enum.StrEnum):
    """Why a generation stopped."""

    STOP = "stop"
    """An end-of-sequence or stop token (or stop string) was produced."""
    LENGTH = "length"
    """`max_new_tokens` or the context limit was reached."""
    ABORT = "abort"
    """The request was aborted (by the caller, or by the engine for a weight update)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one generation. Invalid values fail here, before any work starts."""

    max_new_tokens: int = 256
    """Tokens to generate at most."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy. Log-probs are those of the distribution sampled from."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end the generation (kept in the output), besides the model's end-of-sequence."""
    stop_strings: tuple[str, ...] = ()
    """Text that ends the generation when the decoded output ends with it (e.g. `</tool_call>`)."""
    seed: int | None = None
    """Seed of this request's sampler (None: the engine's generator)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token (benchmarks; SGLang has the same switch)."""

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            problems.append(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            problems.append(f"top_k must be an int >= 0, got {self.top_k!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            problems.append("stop_token_ids must be non-negative ints")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            problems.append("stop_strings must be non-empty strings")
        if problems:
            raise ValueError("invalid sampling parameters: " + "; ".join(problems))


@dataclass(frozen=True)
class Generation:
    """What one `generate` call produced."""

    tokens: tuple[int, ...]
    """Generated token ids (the prompt excluded)."""
    logprobs: tuple[float, ...]
    """Behaviour log-prob of each generated token under the distribution it was sampled from."""
    versions: tuple[int, ...]
    """Policy version that produced each token."""
    finish_reason: FinishReason
    routed_experts: np.ndarray | None = field(default=None, compare=False)
    """Experts routed to, when asked for and the model is a MoE: `[layers, top_k]` per input position
    from `routed_experts_start` up to the last one whose next token was computed, i.e. rows
    `[routed_experts_start, len(prompt) + len(tokens) - 1)` of SGLang's layout (row p = the forward
    whose input was position p; see `pacerl.agents.routing`)."""
    routed_experts_start: int = 0
    """The input position of the first row of `routed_experts` (the `routed_experts_start_len` asked
    for; 0: the whole sequence)."""

    def __post_init__(self) -> None:
        if not len(self.tokens) == len(self.logprobs) == len(self.versions):
            raise ValueError("tokens, logprobs and versions must have one entry per generated token")
        start = self.routed_experts_start
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"routed_experts_start must be an int >= 0, got {start!r}")


class Engine(Protocol):
    """An inference engine the rollout driver talks to."""

    @property
    def version(self) -> int:
        """The policy version of the weights now loaded."""
        ...

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        return_routed_experts: bool = False,
        session: str | None = None,
    ) -> Generation:
        """Generate from `input_ids`. `session` names the episode the call belongs to (the rollout
        driver passes the trajectory id): a router over several replicas sends the turns of one
        session to the same replica, whose prefix cache holds their conversation; a single engine
        ignores it."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None: ...

    async def health(self) -> bool: ...

    async def aclose(self) -> None: ...


class EngineWithRoutesStart(Engine, Protocol):
    """An engine that answers the routes of new positions only: SGLang's `routed_experts_start_len`
    (the embedded engine and the SGLang client are; a proxy that does not forward the argument is a
    plain `Engine`, whose answers hold every row of the stream)."""

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
        session: str | None = None,
    ) -> Generation:
        """As `Engine.generate`; with `return_routed_experts`, the routes of input positions
        `routed_experts_start_len` (in `[0, len(input_ids)]`) up to the last computed one, so a caller
        that holds the rows of the first positions (an earlier turn, an interrupted generation being
        resumed) asks only for the new ones (`Generation.routed_experts_start` says where they start)."""
        ...
