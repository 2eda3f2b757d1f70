"""The learner: one optimizer step on a batch of trajectory groups, with every loss of `pacerl.trainer.losses`
one config switch away, R3 routing replay, and bad input turned into counted skips.

`Learner` coordinates the pieces of a step, each in a module of its own:

- `pacerl.trainer.batch_prep`: the trajectories that carry signal, their advantages, the update plan;
- `pacerl.trainer.scoring`: the model's log-probs as the learner takes them (R3 replay, temperature, device),
  the proximal pass, PACE's prefix drift and the training–inference mismatch;
- `pacerl.trainer.update_step`: one optimizer update, exactly micro-batched, with the policy loss, SAT's
  quantile over the mini-batch, the entropy bonus, the KL to the reference, and the gradient clip;
- `pacerl.trainer.step_metrics`: the step's figures; `pacerl.trainer.learner_state`: published weights,
checkpoints;
  `pacerl.trainer.model_setup`: the MoE layout, gradient checkpointing and the frozen reference.

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

Skips, each counted in `Learner.counts` under its reason and never reaching the weights:
`failed_member`, `empty_response` and `zero_advantage` (left out of the batch: `pacerl.trainer.batch_prep`),
`no_signal` (nothing left in the batch: no update), `nonfinite_logprobs` and `nonfinite_grad` (the
update is abandoned, the weights stay as they were: `pacerl.trainer.update_step`). Routes recorded for another
model shape are a configuration error: ValueError.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from torch import nn

from pacerl.agents.models import check_replay_support
from pacerl.agents.trajectory import Trajectory
from pacerl.trainer.batch import TokenBatch
from pacerl.trainer.batch_prep import (
    ADVANTAGES,
    AdvantageName,
    AdvantageStd,
    PlannedUpdate,
    PreparedBatch,
    prepare_batch,
    update_plan,
)
from pacerl.trainer.distributed import MixedPrecision, Ranks, shard
from pacerl.trainer.learner_state import (
    TrainedModules,
    load_memory_state,
    load_state,
    memory_state,
    publishable_weights,
    save_state,
)
from pacerl.trainer.model_setup import enable_gradient_checkpointing, frozen_copy, moe_layout
from pacerl.trainer.policy_losses import LossConfig, check_choice
from pacerl.trainer.scoring import Scorer
from pacerl.trainer.step_metrics import StepTotals, batch_figures, update_figures
from pacerl.trainer.update_step import UpdateStep


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
    advantage_std: AdvantageStd = "population"
    """grpo's group std: population (default: each group's advantages have unit variance, so a group of
    two is ±1; the setting docs/learnability.md's learning rate was tuned with) or unbiased (verl, TRL:
    larger by sqrt(G/(G-1)), 1.155× at G=4; choose it to compare with their runs)."""
    drop_zero_advantage: bool = True
    """Leave out groups whose rewards are all equal (they carry no signal)."""
    parallel: Literal["none", "fsdp"] = "none"
    """none: one process holds the model; fsdp: `world_size` ranks each hold a shard of the parameters,
    gradients and optimizer state (PyTorch FSDP2, `pacerl.trainer.distributed`) and share every update's
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
    (`pacerl.trainer.distributed.LearnerGroup`)."""

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
        if self.config.routing_replay:  # an MoE R3 cannot replay fails here, not after the first rollouts
            check_replay_support(model)
        layers, top_k = moe_layout(model)
        if self.config.gradient_checkpointing:
            enable_gradient_checkpointing(model, moe=layers > 0)
        # The reference is copied before sharding and sharded like the model (its own FSDP units).
        self.reference = frozen_copy(model) if self.config.loss.kl_coef > 0 else None
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
        self._scorer = Scorer(
            model,
            pad_id,
            layers=layers,
            top_k=top_k,
            device=self.device,
            temperature=self.config.temperature,
            replay_routes=self.config.routing_replay,
        )
        # Resolved once: a loss named module:NAME would otherwise be looked up on every micro-batch.
        loss, settings = self.config.loss.loss, self.config.loss.settings
        self._uses_proximal = loss.uses_proximal(settings)
        self._updates = UpdateStep(
            scorer=self._scorer,
            optimizer=self.optimizer,
            ranks=self.ranks,
            loss=loss,
            settings=settings,
            config=self.config.loss,
            grad_clip=self.config.grad_clip,
            micro_batch_size=self.config.micro_batch_size,
            reference=self.reference,
        )

    # -- training -------------------------------------------------------------------------------------

    def train_step(self, groups: Sequence[Sequence[Trajectory]]) -> StepResult:
        """`minibatches` × `epochs` optimizer updates on `groups` (each the trajectories of one prompt)."""
        started = time.perf_counter()
        ids = tuple(t.id for group in groups for t in group)
        metrics = batch_figures(groups)
        prepared = self._prepare(groups)
        if not prepared.trajectories:
            self.counts["no_signal"] += 1
            return StepResult(False, "no_signal", metrics, ids)
        plan = self._update_plan(prepared)
        totals = StepTotals()
        skips: list[str] = []
        grad_norms: list[float] = []
        self.model.train()
        try:
            proximal = None
            if len(plan) > 1 and self._uses_proximal:
                size = self.config.micro_batch_size
                proximal = self._scorer.proximal(prepared.trajectories, size, self.ranks)
            for epoch, members in plan:
                reason, grad_norm = self._updates.run(
                    prepared,
                    members,
                    proximal,
                    moved=bool(grad_norms),
                    first_epoch=epoch == 0,
                    version=self.version,
                    totals=totals,
                )
                if reason:
                    self.optimizer.zero_grad(set_to_none=True)
                    skips.append(reason)
                    self.counts[reason] += 1
                else:
                    grad_norms.append(grad_norm)
        finally:
            self.model.eval()
        totals = totals.summed_over(self.ranks)
        if not grad_norms:
            return StepResult(False, skips[0], metrics, ids)
        self.version += 1
        elapsed = time.perf_counter() - started
        metrics.update(totals.means())
        metrics.update(
            update_figures(
                grad_norms, skips, prepared.trajectories, planned_updates=len(plan), elapsed=elapsed
            )
        )
        return StepResult(True, "", metrics, ids)

    def _prepare(self, groups: Sequence[Sequence[Trajectory]]) -> PreparedBatch:
        """The trajectories of `groups` that carry signal, with their advantages (leave-outs counted)."""
        return prepare_batch(
            groups,
            advantage=self.config.advantage,
            advantage_std=self.config.advantage_std,
            drop_zero_advantage=self.config.drop_zero_advantage,
            counts=self.counts,
        )

    def _update_plan(self, prepared: PreparedBatch) -> list[PlannedUpdate]:
        """(epoch, trajectory positions) of each update of this step
        (`pacerl.trainer.batch_prep.update_plan`)."""
        config = self.config
        return update_plan(
            prepared.group_index,
            minibatches=config.minibatches,
            epochs=config.epochs,
            shuffle_seed=config.shuffle_seed,
            version=self.version,
        )

    # -- scoring without training ---------------------------------------------------------------------

    def collate(self, trajectories: Sequence[Trajectory]) -> TokenBatch:
        """Pad trajectories for this model (routes shaped to its MoE layout), on its device."""
        return self._scorer.collate(trajectories)

    def logprobs(
        self, trajectories: Sequence[Trajectory], *, replay_routes: bool | None = None
    ) -> tuple[TokenBatch, torch.Tensor, float]:
        """Current-policy log-probs of `trajectories` (no gradient): the batch, `[B, T-1]` log-probs and
        the share of replayed routes the live router disagrees with (0 without replay)."""
        return self._scorer.logprobs(trajectories, replay_routes=replay_routes)

    def prefix_drift(self, trajectories: Sequence[Trajectory]) -> list[float]:
        """PACE's forgetting score per trajectory: mean |log π_now − log μ| over its model tokens."""
        return self._scorer.prefix_drift(trajectories, self.config.micro_batch_size)

    def mismatch(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """Training–inference mismatch with and without R3 (`pacerl.trainer.scoring.Scorer.mismatch`)."""
        return self._scorer.mismatch(trajectories)

    # -- weights and state ----------------------------------------------------------------------------

    def weights(self) -> dict[str, torch.Tensor]:
        """The current weights to publish (detached views; the engine copies them). Sharded: every rank
        calls it, rank 0 gets the full tensors (on the CPU) and the others an empty dict."""
        return publishable_weights(self.model)

    def save(self, directory: Path) -> None:
        """Write model, optimizer (and reference) state with torch.distributed.checkpoint into
        `directory`/learner, each rank its own shards, and version and counts into learner.json. A
        checkpoint saved with any number of ranks loads with any other (`load`). Every rank calls it."""
        save_state(directory, self._modules(), version=self.version, counts=self.counts, rank=self.ranks.rank)

    def load(self, directory: Path) -> None:
        """The inverse of `save`, resharded to this learner's ranks; a checkpoint of runs before sharded
        saves (one `learner.pt`) loads into an unsharded learner."""
        self.version, self.counts = load_state(directory, self._modules())

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, version and counts of an unsharded learner, in memory (`save` writes a
        checkpoint, sharded or not)."""
        return memory_state(self._modules(), version=self.version, counts=self.counts)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The inverse of `state_dict`."""
        self.version, self.counts = load_memory_state(state, self._modules())

    def _modules(self) -> TrainedModules:
        return TrainedModules(self.model, self.optimizer, self.reference)
