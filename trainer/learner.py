"""The learner: one optimizer step on a batch of trajectory groups, with every loss of `trainer.losses`
one config switch away, R3 routing replay, and bad input turned into counted skips.

Updates per batch. `train_step` shuffles the batch's groups and splits them into `minibatches` disjoint
mini-batches of whole groups, one optimizer update each, for `epochs` passes (AReaL's
`ppo_n_minibatches`, verl's `ppo_mini_batch_size` and `ppo_epochs`). The proximal policy of decoupled PPO
and the `recompute` ratio anchor are the weights before the first update: their log-probs are computed
once, in a no-grad pass over the whole batch, so the clip and SAT act on the second and later updates.
With a single update (the default: docs/learnability.md's recipe) that pass would return the detached
log-probs of the update's own forward, so it is not spent. With `ratio_anchor="behaviour"` the ratio is taken
against the rollout engine's log-probs, as the SAT paper does: the clip then bounds how far a stale sample
may pull from the first update on.

Policy versions count batches, not optimizer updates: `version` advances by one per `train_step` that
applied at least one update (one publication to the engines per batch), however many updates the batch
took, as AReaL's global step and verl's training step do. Staleness (a trajectory's version lag) is
therefore measured in batches.

Exact micro-batching. Each update accumulates gradients over micro-batches of whole groups (at most
`micro_batch_size` sequences, unless one group is larger). Every loss is given the update's own
denominator (its trainable tokens for token means, its sequences for sequence means:
`trainer.losses.mean_unit`) and SAT's quantile over the whole mini-batch, so the accumulated gradient is
the one-chunk gradient for every loss, with any `micro_batch_size`. The quantile costs a no-grad pass over
the mini-batch when it spans several micro-batches (the proximal pass serves for the first update).

Skips, each counted in `Learner.counts` under its reason and never reaching the weights:
`failed_member` (a trajectory without a reward is left out of its group's advantages), `empty_response`
(no model token: nothing to train on, but its reward still counts in its group), `zero_advantage`
(a group whose rewards are all equal carries no signal), `no_signal` (nothing left in the batch: no
update), `nonfinite_logprobs` and `nonfinite_grad` (the step is abandoned, the weights stay as they
were). Routes recorded for another model shape are a configuration error: ValueError.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import json
import math
import random
import time
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from agents.models import check_replay_support, moe_info
from agents.trajectory import Trajectory
from trainer.advantages import dr_grpo_advantages, grpo_advantages, reinforce_pp_baseline_advantages
from trainer.batch import TokenBatch, collate, forward_logprobs
from trainer.distributed import MixedPrecision, Ranks, is_sharded, shard
from trainer.losses import LossOutput, entropy_from_logits, kl_k3, sat_threshold, sequence_staleness
from trainer.policy_losses import LossConfig, LossInputs, check_choice, sat_config

AdvantageName = Literal["grpo", "dr_grpo", "reinforce_pp"]
_PER_TOKEN = ("loss", "entropy", "kl")
"""Per-micro-batch figures, averaged over every update of the step weighted by trainable tokens."""
_PER_UNIT = ("clip_fraction", "sat_gate_rate", "sat_active_rate", "sat_contraction")
"""Shares, averaged over every update weighted by the entries they count (tokens, sequences, groups)."""
_FIRST_PASS = ("mismatch", "mismatch_fresh", "routing_disagreement", "r3_coverage")
"""Engine-vs-trainer figures from the first epoch (each trajectory once), weighted by tokens."""
LEARNER_SHARDS = "learner"
"""The directory of a checkpoint that holds the learner's torch.distributed.checkpoint shards."""
LEARNER_META = "learner.json"
"""The file of a checkpoint that holds the learner's version and skip counts."""
ADVANTAGES: tuple[AdvantageName, ...] = ("grpo", "dr_grpo", "reinforce_pp")


@dataclass(frozen=True)
class LearnerConfig:
    """The optimizer step."""

    loss: LossConfig = field(default_factory=LossConfig)
    """The policy loss."""
    advantage: AdvantageName = "grpo"
    """Advantage estimator: grpo (group mean/std), dr_grpo (group mean), reinforce_pp (group mean,
    batch std)."""
    lr: float = 1e-4
    """Adam learning rate (docs/learnability.md: 1e-4 is stable on the tiny MoE, 5e-4 spikes)."""
    betas: tuple[float, float] = (0.9, 0.99)
    """Adam betas."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clip."""
    temperature: float = 1.0
    """The rollout's sampling temperature: log-probs are taken of logits / temperature, as sampled."""
    routing_replay: bool = True
    """R3: replay the engine's recorded experts in the training forward (MoE models)."""
    micro_batch_size: int = 64
    """Sequences per forward/backward (whole groups; gradients accumulate over micro-batches, exactly:
    the gradient does not depend on this size)."""
    gradient_checkpointing: bool = False
    """Keep only each decoder layer's inputs through the forward and recompute the rest in the backward
    (transformers' gradient checkpointing, non-reentrant): activation memory of one layer instead of
    all, for about one more forward per micro-batch; the update is the same. Dense models only (an
    MoE's recomputed layers would route without R3's recorded experts)."""
    minibatches: int = 1
    """Optimizer updates per epoch: the batch's groups, shuffled, split into this many disjoint
    mini-batches of whole groups (fewer when the batch has fewer groups)."""
    epochs: int = 1
    """Passes over the batch; each pass reshuffles the groups. Updates per batch = minibatches × epochs."""
    shuffle_seed: int = 0
    """Seeds the mini-batch shuffle (with the version, so a resumed run shuffles as the original)."""
    advantage_std: Literal["population", "unbiased"] = "population"
    """grpo's group std: population (default: each group's advantages have unit variance, so a group of
    two is ±1; the setting docs/learnability.md's learning rate was tuned with) or unbiased (verl, TRL:
    larger by sqrt(G/(G-1)), 1.155× at G=4; choose it to compare with their runs)."""
    drop_zero_advantage: bool = True
    """Leave out groups whose rewards are all equal (they carry no signal)."""
    parallel: Literal["none", "fsdp"] = "none"
    """none: one process holds the model; fsdp: `world_size` ranks each hold a shard of the parameters,
    gradients and optimizer state (PyTorch FSDP2, `trainer.distributed`) and share every update's
    micro-batches; the update equals one process's."""
    world_size: int = 1
    """Ranks of `parallel=fsdp` (`pacerl train` starts them; under torchrun, its WORLD_SIZE)."""
    mixed_precision: MixedPrecision = "auto"
    """fsdp's compute precision: bf16 (fp32 master weights and gradient reduction), fp32, or auto (bf16 on
    GPU, fp32 on CPU)."""

    def __post_init__(self) -> None:
        if self.advantage not in ADVANTAGES:
            raise ValueError(f"advantage must be one of {ADVANTAGES}, got {self.advantage!r}")
        if not (self.lr > 0 and self.grad_clip > 0 and self.temperature > 0 and self.micro_batch_size >= 1):
            raise ValueError("need lr > 0, grad_clip > 0, temperature > 0 and micro_batch_size >= 1")
        if self.minibatches < 1 or self.epochs < 1:
            raise ValueError(f"need minibatches >= 1 and epochs >= 1, got {self.minibatches}, {self.epochs}")
        if self.advantage_std not in ("population", "unbiased"):
            raise ValueError(f"advantage_std must be population or unbiased, got {self.advantage_std!r}")
        if not all(0 <= beta < 1 for beta in self.betas) or self.weight_decay < 0:
            raise ValueError(f"betas must lie in [0, 1) and weight_decay >= 0, got {self.betas}")
        check_choice("parallel", self.parallel, ("none", "fsdp"))
        check_choice("mixed_precision", self.mixed_precision, ("auto", "bf16", "fp32"))
        if self.world_size < 1 or (self.parallel == "none" and self.world_size != 1):
            raise ValueError(
                f"world_size must be >= 1, and 1 unless parallel=fsdp; got {self.world_size} with "
                f"parallel={self.parallel}"
            )


@dataclass(frozen=True)
class StepResult:
    """What one `train_step` did."""

    updated: bool
    """Whether the weights changed (False: the step was skipped; see `skipped`)."""
    skipped: str
    """Why no update happened ("" when updated)."""
    metrics: dict[str, float]
    """Per-step figures: reward, accuracy, entropy, grad_norm, clip_fraction, sat_gate_rate (share
    gated), sat_active_rate (share where SAT's contracted bound was the active term: where it changed the
    gradient), sat_contraction, mismatch, routing_disagreement, r3_coverage (share of the inputs the
    trained tokens depend on, prompt, tool and model positions, whose routing was replayed), updates,
    skipped_updates, tokens, tokens_per_s, ..."""
    trajectory_ids: tuple[str, ...]
    """Every trajectory of the batch (trained on or skipped: none of them will be seen again)."""


class LearnerLike(Protocol):
    """What the training loop needs of a learner: a `Learner` in this process, or a handle on one that
    runs elsewhere (a Ray actor, `pacerl.ray_runtime.learner.RemoteLearner`) or across ranks
    (`trainer.distributed.LearnerGroup`)."""

    @property
    def version(self) -> int:
        """Updates applied so far."""

    @property
    def counts(self) -> Counter[str]:
        """Skips and leave-outs by reason."""

    def train_step(self, groups: Sequence[Sequence[Trajectory]]) -> StepResult: ...

    def prefix_drift(self, trajectories: Sequence[Trajectory]) -> list[float]: ...

    def weights(self) -> Mapping[str, torch.Tensor]: ...

    def save(self, directory: Path) -> None: ...

    def load(self, directory: Path) -> None: ...


@dataclass
class _Prepared:
    trajectories: list[Trajectory]
    advantages: list[float]
    group_index: list[int]


@dataclass
class _Totals:
    """Running sums of the step's figures and their weights."""

    sums: dict[str, float] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)

    def add(self, names: Sequence[str], values: Mapping[str, float], weight: float) -> None:
        for name in names:
            self.sums[name] = self.sums.get(name, 0.0) + values[name] * weight
            self.weights[name] = self.weights.get(name, 0.0) + weight

    def means(self) -> dict[str, float]:
        names = (*_PER_TOKEN, *_PER_UNIT, *_FIRST_PASS)
        return {
            name: self.sums[name] / self.weights[name] if self.weights.get(name) else 0.0 for name in names
        }


class Learner:
    """Owns the trained model and its optimizer; `version` counts the updates made."""

    def __init__(
        self,
        model: nn.Module,
        config: LearnerConfig | None = None,
        *,
        pad_id: int = 0,
        ranks: Ranks | None = None,
    ) -> None:
        self.config = config or LearnerConfig()
        self.pad_id = pad_id
        sharded = self.config.parallel == "fsdp"
        self.ranks = ranks if ranks is not None else Ranks.of_default_group() if sharded else Ranks()
        """This rank's place among the learner's ranks (rank 0 of 1 unless `parallel=fsdp`)."""
        if sharded and self.ranks.size != self.config.world_size:
            raise ValueError(
                f"learner.world_size is {self.config.world_size} but {self.ranks.size} ranks joined"
            )
        self.version = 0
        """Updates applied so far: the policy version of the weights now in `model`."""
        self.counts: Counter[str] = Counter()
        """Skips and leave-outs by reason (see the module docstring)."""
        # Resolved once: a loss named module:NAME would otherwise be looked up on every micro-batch.
        self._policy_loss = self.config.loss.loss
        self._loss_settings = self.config.loss.settings
        if self.config.routing_replay:  # an MoE R3 cannot replay fails here, not after the first rollouts
            check_replay_support(model)
        try:
            info = moe_info(model)
            self._layers, self._top_k = info.num_layers, info.top_k
        except ValueError:  # a dense model: nothing to replay
            self._layers, self._top_k = 0, 0
        if self.config.gradient_checkpointing:
            _enable_checkpointing(model, moe=self._layers > 0)
        # The reference is copied before sharding and sharded like the model (its own FSDP units).
        self.reference = _frozen_copy(model) if self.config.loss.kl_coef > 0 else None
        if sharded:
            shard(model, self.config.mixed_precision)
            if self.reference is not None:
                shard(self.reference, self.config.mixed_precision)
        self.model = model
        self.device = next(model.parameters()).device
        """Where the model computes (a sharded model's shards moved to its rank's GPU under NCCL); every
        batch is moved there."""
        # After sharding: the optimizer holds the shards (DTensors), not the full parameters.
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=self.config.lr,
            betas=self.config.betas,
            weight_decay=self.config.weight_decay,
        )

    # -- training -------------------------------------------------------------------------------------

    def train_step(self, groups: Sequence[Sequence[Trajectory]]) -> StepResult:
        """`minibatches` × `epochs` optimizer updates on `groups` (each the trajectories of one prompt)."""
        started = time.perf_counter()
        ids = tuple(t.id for group in groups for t in group)
        rewards = [t.reward for group in groups for t in group if t.reward is not None]
        metrics: dict[str, float] = {
            "reward": _mean(rewards),
            "accuracy": _mean([float(r >= 1.0) for r in rewards]),
            "trajectories": float(len(ids)),
        }
        prepared = self._prepare(groups)
        if not prepared.trajectories:
            return self._skip("no_signal", metrics, ids)
        plan = self._update_plan(prepared)
        totals = _Totals()
        skips: list[str] = []
        grad_norms: list[float] = []
        self.model.train()
        try:
            proximal = self._proximal(prepared) if len(plan) > 1 and self._uses_proximal() else None
            for epoch, members in plan:
                moved = bool(grad_norms)
                reason, grad_norm = self._update(prepared, members, proximal, moved, epoch == 0, totals)
                if reason:
                    self.optimizer.zero_grad(set_to_none=True)
                    skips.append(reason)
                    self.counts[reason] += 1
                else:
                    grad_norms.append(grad_norm)
        finally:
            self.model.eval()
        if self.ranks.size > 1:  # each rank added up its own micro-batches
            totals = _Totals(self.ranks.sum_floats(totals.sums), self.ranks.sum_floats(totals.weights))
        if not grad_norms:
            return StepResult(False, skips[0], metrics, ids)
        self.version += 1
        elapsed = time.perf_counter() - started
        tokens = sum(t.num_model_tokens for t in prepared.trajectories)
        metrics.update(totals.means())
        metrics.update(
            grad_norm=_mean(grad_norms),
            updates=float(len(grad_norms)),
            skipped_updates=float(len(skips)),
            tokens=float(tokens),
            trained_trajectories=float(len(prepared.trajectories)),
            step_s=elapsed,
            tokens_per_s=tokens * len(plan) / elapsed,
        )
        return StepResult(True, "", metrics, ids)

    def _prepare(self, groups: Sequence[Sequence[Trajectory]]) -> _Prepared:
        prepared = _Prepared([], [], [])
        kept_groups = 0
        for group in groups:
            members = [t for t in group if t.reward is not None]
            self.counts["failed_member"] += len(group) - len(members)
            if not members:
                continue
            values = torch.tensor([[float(t.reward or 0.0) for t in members]], dtype=torch.float64)
            if self.config.drop_zero_advantage and bool((values == values[0, 0]).all()):
                self.counts["zero_advantage"] += 1
                continue
            advantages = self._advantages(values)
            index, kept_groups = kept_groups, kept_groups + 1
            for trajectory, advantage in zip(members, advantages.tolist(), strict=True):
                if trajectory.num_model_tokens == 0:
                    self.counts["empty_response"] += 1
                    continue
                prepared.trajectories.append(trajectory)
                prepared.advantages.append(advantage)
                prepared.group_index.append(index)
        if self.config.advantage == "reinforce_pp" and prepared.advantages:
            # REINFORCE++'s normalisation is over the whole batch, not one group.
            centred = torch.tensor([prepared.advantages], dtype=torch.float64)
            prepared.advantages = reinforce_pp_baseline_advantages(centred)[0].tolist()
        return prepared

    def _advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        if self.config.advantage == "grpo":
            return grpo_advantages(rewards, unbiased=self.config.advantage_std == "unbiased")[0]
        return dr_grpo_advantages(rewards)[0]  # reinforce_pp: centred here, normalised per batch later

    def _update_plan(self, prepared: _Prepared) -> list[tuple[int, list[int]]]:
        """(epoch, trajectory indices) of each update: per epoch the groups shuffled and split into
        `minibatches` runs of whole groups (members of a group stay consecutive)."""
        members: dict[int, list[int]] = {}
        for position, group in enumerate(prepared.group_index):
            members.setdefault(group, []).append(position)
        order = list(members)
        count = min(self.config.minibatches, len(order))
        shuffle = random.Random(self.config.shuffle_seed * 1_000_003 + self.version)
        plan: list[tuple[int, list[int]]] = []
        for epoch in range(self.config.epochs):
            if count > 1 or self.config.epochs > 1:
                shuffle.shuffle(order)
            for part in range(count):
                groups = order[part * len(order) // count : (part + 1) * len(order) // count]
                plan.append((epoch, [i for group in groups for i in members[group]]))
        return plan

    def _micro_batches(self, prepared: _Prepared, members: list[int]) -> list[list[int]]:
        """`members` in chunks of whole groups, about `micro_batch_size` sequences each."""
        chunks: list[list[int]] = [[]]
        # A group's members are consecutive in `members`, so they form one run.
        for _, run in itertools.groupby(members, key=prepared.group_index.__getitem__):
            group = list(run)
            if chunks[-1] and len(chunks[-1]) + len(group) > self.config.micro_batch_size:
                chunks.append([])
            chunks[-1].extend(group)
        return chunks

    def _uses_proximal(self) -> bool:
        """Whether the loss reads the log-probs of the weights before the step's first update."""
        return self._policy_loss.uses_proximal(self._loss_settings)

    @torch.no_grad()
    def _proximal(self, prepared: _Prepared) -> list[torch.Tensor]:
        """Log-probs of every trajectory's targets under the weights before the first update, `[T-1]`
        each (a no-grad pass over the whole batch, in micro-batches)."""
        size, count = self.config.micro_batch_size, len(prepared.trajectories)
        rows: dict[int, torch.Tensor] = {}
        for start, mine in self.ranks.share(range(0, count, size)):
            trajectories = prepared.trajectories[start : start + size]
            logprobs, _, _ = self._forward(self.collate(trajectories))
            if mine:
                rows.update(
                    {start + row: logprobs[row, : len(t.tokens) - 1] for row, t in enumerate(trajectories)}
                )
        if self.ranks.size > 1:
            # Through the CPU: the object group pickles what it gathers.
            shared = self.ranks.gather({index: row.cpu() for index, row in rows.items()})
            rows = {index: row.to(self.device) for part in shared for index, row in part.items()}
        return [rows[index] for index in range(count)]

    def _forward(self, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor, Any]:
        return forward_logprobs(
            self.model, batch, temperature=self.config.temperature, replay_routes=self.config.routing_replay
        )

    def _update(
        self,
        prepared: _Prepared,
        members: list[int],
        proximal: list[torch.Tensor] | None,
        moved: bool,
        first_epoch: bool,
        totals: _Totals,
    ) -> tuple[str, float]:
        """One optimizer update on `members`; returns (skip reason or "", the gradient norm)."""
        chunks = self._micro_batches(prepared, members)
        trajectories = [prepared.trajectories[i] for i in members]
        unit = self._policy_loss.mean_unit(self._loss_settings)
        tokens = sum(t.num_model_tokens for t in trajectories)
        denominator = float(tokens if unit == "token" else len(trajectories))
        # This rank's micro-batches (all of them in one process), collated once: SAT's quantile pass and
        # the training pass read the same batches.
        mine = self.ranks.share(chunks)
        batches = [self.collate([prepared.trajectories[i] for i in chunk]) for chunk, _ in mine]
        threshold = self._sat_threshold(len(chunks), mine, batches, proximal, moved)
        self.optimizer.zero_grad(set_to_none=True)
        for (chunk, counted), batch in zip(mine, batches, strict=True):
            reason = self._accumulate(
                prepared,
                chunk,
                batch,
                proximal,
                (denominator, tokens, threshold),
                first_epoch,
                totals,
                counted,
            )
            if reason:
                return reason, 0.0
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip))
        if not math.isfinite(grad_norm):
            return "nonfinite_grad", 0.0
        self.optimizer.step()
        return "", grad_norm

    def _sat_threshold(
        self,
        count: int,
        mine: list[tuple[list[int], bool]],
        batches: list[TokenBatch],
        proximal: list[torch.Tensor] | None,
        moved: bool,
    ) -> torch.Tensor | None:
        """SAT's quantile over the whole mini-batch (`count` micro-batches, this rank's `mine`, every
        rank's values) at the current weights; None when one micro-batch holds it (the loss then takes its
        own) or SAT is off."""
        measure, sat = self._policy_loss.sat, sat_config(self.config.loss)
        if sat is None or measure is None or count < 2:
            return None
        values: list[torch.Tensor] = []
        for (chunk, counted), batch in zip(mine, batches, strict=True):
            if proximal is not None and not moved:  # the weights of the proximal pass are these
                current = _padded([proximal[i] for i in chunk], batch.loss_mask.shape)
            else:
                with torch.no_grad():
                    current, _, _ = self._forward(batch)
            mask, behaviour = batch.loss_mask, batch.behaviour.to(current.dtype)
            if not counted:
                continue
            if measure == "sequence":
                values.append(sequence_staleness(current, behaviour, mask)[mask.any(-1)])
            else:
                values.append((current - behaviour)[mask])
        if self.ranks.size > 1:
            values = [
                part.to(self.device)
                for parts in self.ranks.gather([v.cpu() for v in values])
                for part in parts
            ]
        staleness = torch.cat(values)
        return sat_threshold(staleness, torch.ones_like(staleness, dtype=torch.bool), sat)

    def _accumulate(
        self,
        prepared: _Prepared,
        chunk: list[int],
        batch: TokenBatch,
        proximal: list[torch.Tensor] | None,
        whole: tuple[float, int, torch.Tensor | None],
        first_epoch: bool,
        totals: _Totals,
        counted: bool = True,
    ) -> str:
        """Forward and backward one micro-batch, its loss normalised by the whole mini-batch
        (`whole` = its loss denominator, its trainable tokens, SAT's threshold); returns a skip reason
        or "" (the same on every rank). `counted` False: another rank's micro-batch run only so that
        this rank enters the same collectives; its gradient is multiplied by 0 and its figures dropped."""
        denominator, update_tokens, threshold = whole
        logprobs, logits, stats = self._forward(batch)
        mask = batch.loss_mask
        finite = bool(torch.isfinite(logprobs[mask]).all())
        if self.ranks.agree("" if finite else "nonfinite_logprobs"):
            return "nonfinite_logprobs"
        advantages = torch.tensor(
            [prepared.advantages[i] for i in chunk], dtype=logprobs.dtype, device=logprobs.device
        )
        groups = torch.tensor(
            [prepared.group_index[i] for i in chunk], dtype=torch.long, device=logprobs.device
        )
        anchor = logprobs.detach() if proximal is None else _padded([proximal[i] for i in chunk], mask.shape)
        output = self._loss(logprobs, anchor, batch, advantages, groups, threshold, denominator)
        chunk_tokens = batch.num_tokens
        # Entropy and KL are token means: this chunk's share of the update's is its share of tokens.
        share = chunk_tokens / update_tokens
        loss = output.loss
        entropy_coef = self.config.loss.entropy_coef
        entropy = None
        if entropy_coef:
            entropy = entropy_from_logits(logits, mask, self.config.temperature)
            loss = loss - entropy_coef * entropy * share
        kl = self._kl(logprobs, batch)
        if kl is not None:
            loss = loss + self.config.loss.kl_coef * kl * share
        # FSDP averages over ranks what is here a sum of the ranks' shares of one loss (see `shard`).
        torch.autograd.backward(loss * (self.ranks.size if counted else 0.0))
        if not counted:
            return ""
        with torch.no_grad():
            if entropy is None:
                # Only a diagnostic: taken after the backward pass and without a graph, so that its
                # [tokens, vocab] intermediates are neither recorded nor held through the backward
                # (the same value: the logits do not change). Non-finite logits on trained tokens
                # ended the micro-batch above (`nonfinite_logprobs`), as entropy_from_logits would.
                entropy = entropy_from_logits(logits, mask, self.config.temperature)
            # The shares' own entries: tokens (grpo, decoupled_ppo), sequences (gspo), groups (gmc).
            entries = self._policy_loss.entries
            units = {"token": chunk_tokens, "group": len(set(groups.tolist())), "sequence": len(chunk)}
            totals.add(
                _PER_TOKEN,
                {
                    "loss": float(output.loss) / share if share else 0.0,
                    "entropy": float(entropy),
                    "kl": float(kl) if kl is not None else 0.0,
                },
                chunk_tokens,
            )
            totals.add(
                _PER_UNIT,
                {
                    "clip_fraction": float(output.clip_fraction),
                    "sat_gate_rate": float(output.gate_rate),
                    "sat_active_rate": float(output.sat_active),
                    "sat_contraction": float(output.mean_contraction),
                },
                units[entries],
            )
            if first_epoch:
                log_ratio = (logprobs - batch.behaviour)[mask]
                fresh = (batch.versions == self.version)[mask]
                totals.add(
                    _FIRST_PASS,
                    {
                        "mismatch": float(log_ratio.abs().mean()),
                        "mismatch_fresh": float(log_ratio[fresh].abs().mean()) if bool(fresh.any()) else 0.0,
                        "routing_disagreement": stats.disagreement if stats is not None else 0.0,
                        "r3_coverage": batch.replay_coverage() if stats is not None else 0.0,
                    },
                    chunk_tokens,
                )
        return ""

    def _loss(
        self,
        logprobs: torch.Tensor,
        proximal: torch.Tensor,
        batch: TokenBatch,
        advantages: torch.Tensor,
        groups: torch.Tensor,
        threshold: torch.Tensor | None,
        denominator: float,
    ) -> LossOutput:
        """The configured loss of one micro-batch; `proximal`: log-probs before the step's first update."""
        inputs = LossInputs(
            logprobs=logprobs,
            proximal=proximal,
            behaviour=batch.behaviour.to(logprobs.dtype),
            advantages=advantages,
            mask=batch.loss_mask,
            groups=groups,
            sat_threshold=threshold,
            denominator=denominator,
        )
        return self._policy_loss.compute(inputs, self.config.loss)

    def _kl(self, logprobs: torch.Tensor, batch: TokenBatch) -> torch.Tensor | None:
        if self.reference is None:
            return None
        with torch.no_grad():
            reference, _, _ = forward_logprobs(
                self.reference,
                batch,
                temperature=self.config.temperature,
                replay_routes=self.config.routing_replay,
            )
        return kl_k3(logprobs, reference, batch.loss_mask)

    def _skip(self, reason: str, metrics: dict[str, float], ids: tuple[str, ...]) -> StepResult:
        self.counts[reason] += 1
        return StepResult(False, reason, metrics, ids)

    # -- scoring without training ---------------------------------------------------------------------

    def collate(self, trajectories: Sequence[Trajectory]) -> TokenBatch:
        """Pad trajectories for this model (routes shaped to its MoE layout)."""
        batch = collate(trajectories, self.pad_id, layers=self._layers, top_k=self._top_k)
        if self.device.type == "cpu":
            return batch
        moved = {
            name: value.to(self.device, non_blocking=True) if isinstance(value, torch.Tensor) else value
            for name, value in vars(batch).items()
        }
        return dataclasses.replace(batch, **moved)

    @torch.no_grad()
    def logprobs(
        self, trajectories: Sequence[Trajectory], *, replay_routes: bool | None = None
    ) -> tuple[TokenBatch, torch.Tensor, float]:
        """Current-policy log-probs of `trajectories` (no gradient): the batch, `[B, T-1]` log-probs and
        the share of replayed routes the live router disagrees with (0 without replay)."""
        replay = self.config.routing_replay if replay_routes is None else replay_routes
        batch = self.collate(trajectories)
        logprobs, _, stats = forward_logprobs(
            self.model, batch, temperature=self.config.temperature, replay_routes=replay
        )
        return batch, logprobs, stats.disagreement if stats is not None else 0.0

    def prefix_drift(self, trajectories: Sequence[Trajectory]) -> list[float]:
        """PACE's forgetting score per trajectory: mean |log π_now − log μ| over its model tokens."""
        drifts: list[float] = []
        size = self.config.micro_batch_size
        for start in range(0, len(trajectories), size):
            batch, logprobs, _ = self.logprobs(trajectories[start : start + size])
            gap = (logprobs - batch.behaviour).abs() * batch.loss_mask
            drifts += (gap.sum(-1) / batch.loss_mask.sum(-1).clamp_min(1)).tolist()
        return drifts

    def mismatch(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """Training–inference mismatch with and without R3: mean |log π_θ − log μ| over model tokens,
        and the share of (token, layer) routes where the live router disagrees with the engine's."""
        result: dict[str, float] = {}
        for label, replay in (("r3", True), ("live", False)):
            batch, logprobs, disagreement = self.logprobs(trajectories, replay_routes=replay)
            gap = (logprobs - batch.behaviour)[batch.loss_mask].abs()
            result[f"mismatch_{label}"] = float(gap.mean())
            result[f"mismatch_{label}_max"] = float(gap.max())
            if replay:
                result["routing_disagreement"] = disagreement
        return result

    # -- weights and state ----------------------------------------------------------------------------

    def weights(self) -> dict[str, torch.Tensor]:
        """The current weights to publish (detached views; the engine copies them). Sharded: every rank
        calls it, rank 0 gets the full tensors (on the CPU) and the others an empty dict."""
        if is_sharded(self.model):
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            full = get_model_state_dict(self.model, options=options)
            return {name: value for name, value in full.items() if isinstance(value, torch.Tensor)}
        return {name: tensor.detach() for name, tensor in self.model.state_dict().items()}

    def save(self, directory: Path) -> None:
        """Write model, optimizer (and reference) state with torch.distributed.checkpoint into
        `directory`/learner, each rank its own shards, and version and counts into learner.json. A
        checkpoint saved with any number of ranks loads with any other (`load`). Every rank calls it."""
        with _one_process_quietly():
            dcp_save(self._dcp_state(), checkpoint_id=directory / LEARNER_SHARDS)
        if self.ranks.rank == 0:
            meta = {"version": self.version, "counts": dict(self.counts)}
            (directory / LEARNER_META).write_text(json.dumps(meta), encoding="utf-8")

    def load(self, directory: Path) -> None:
        """The inverse of `save`, resharded to this learner's ranks; a checkpoint of runs before sharded
        saves (one `learner.pt`) loads into an unsharded learner."""
        legacy = directory / "learner.pt"
        if not (directory / LEARNER_SHARDS).is_dir() and legacy.is_file() and not is_sharded(self.model):
            self.load_state_dict(torch.load(legacy, weights_only=False))
            return
        state = self._dcp_state()
        with _one_process_quietly():
            dcp_load(state, checkpoint_id=directory / LEARNER_SHARDS)
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        if self.reference is not None:
            if "reference" not in state:
                raise ValueError(f"{directory} holds no KL reference model, but learner.loss.kl_coef > 0")
            set_model_state_dict(self.reference, state["reference"])
        meta = json.loads((directory / LEARNER_META).read_text(encoding="utf-8"))
        self.version = int(meta["version"])
        self.counts = Counter(meta["counts"])

    def _dcp_state(self) -> dict[str, Any]:
        """The state torch.distributed.checkpoint saves and loads in place (this rank's shards)."""
        model, optimizer = get_state_dict(self.model, self.optimizer)
        state: dict[str, Any] = {"model": model, "optimizer": optimizer}
        if self.reference is not None:
            state["reference"] = get_model_state_dict(self.reference)
        return state

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, version and counts of an unsharded learner, in memory (`save` writes a
        checkpoint, sharded or not)."""
        if is_sharded(self.model):
            raise RuntimeError("a sharded learner's state is saved with `save`, each rank its own shards")
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "version": self.version,
            "counts": dict(self.counts),
            "reference": None if self.reference is None else self.reference.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The inverse of `state_dict`."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.counts = Counter(state["counts"])
        if self.reference is not None and state.get("reference") is not None:
            self.reference.load_state_dict(state["reference"])


@contextlib.contextmanager
def _one_process_quietly() -> Iterator[None]:
    """torch.distributed.checkpoint warns each time it runs without a process group; one process is
    the unsharded learner's normal case, not a mistake."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _enable_checkpointing(model: nn.Module, *, moe: bool) -> None:
    """`learner.gradient_checkpointing` on a dense transformers model; ValueError where it cannot be."""
    name = type(model).__name__
    if moe:
        # R3's replay (and the route capture beside it) are hooks that live through the forward only: the
        # backward's recomputation would route afresh and differ from the forward it replaces.
        raise ValueError(f"learner.gradient_checkpointing works on dense models, not on the MoE {name}")
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"learner.gradient_checkpointing: {name} does not support it")
    enable = cast(Any, model).activation_checkpointing_enable  # transformers' PreTrainedModel
    enable(activation_checkpointing_kwargs={"use_reentrant": False})


def _frozen_copy(model: nn.Module) -> nn.Module:
    reference = copy.deepcopy(model).eval()
    for parameter in reference.parameters():
        parameter.requires_grad_(False)
    return reference


def _padded(rows: Sequence[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """Per-trajectory `[T_i - 1]` rows right-padded with 0 into `shape` (a collated batch's)."""
    out = torch.zeros(shape, dtype=rows[0].dtype, device=rows[0].device)
    for row, values in enumerate(rows):
        out[row, : values.shape[0]] = values
    return out


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
