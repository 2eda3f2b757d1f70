"""One optimizer update of the learner: gradients accumulated over micro-batches of one mini-batch, then
clipped and applied (docs/algorithms.md §8b).

Exact micro-batching. An update accumulates gradients over micro-batches of whole groups (at most
`micro_batch_size` sequences, unless one group is larger). Every loss is given the update's own
denominator (its trainable tokens for token means, its sequences for sequence means:
`PolicyLoss.mean_unit`) and SAT's quantile over the whole mini-batch, so the accumulated gradient is
the one-chunk gradient for every loss, with any `micro_batch_size`. The quantile costs a no-grad pass over
the mini-batch when it spans several micro-batches (the proximal pass serves for the first update).

A micro-batch's loss is its policy loss (`pacerl.trainer.policy_losses`, a pure function of `LossInputs`),
less the entropy bonus, plus the k3 KL to the frozen reference (`micro_batch_loss`). Across ranks
(`pacerl.trainer.distributed`) each rank forwards and backwards its share of the micro-batches, SAT's quantile
is taken over every rank's, and ranks abandon an update together: `nonfinite_logprobs` (a trained
token's log-prob is not finite) and `nonfinite_grad` (the clipped gradient's norm is not) leave the
weights as they were.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pacerl.trainer.batch import TokenBatch, forward_logprobs
from pacerl.trainer.batch_prep import PreparedBatch, micro_batches
from pacerl.trainer.distributed import Ranks
from pacerl.trainer.losses import entropy_from_logits, kl_k3, sat_threshold, sequence_staleness
from pacerl.trainer.policy_losses import LossConfig, LossInputs, PolicyLoss, sat_config
from pacerl.trainer.scoring import Scorer, padded
from pacerl.trainer.step_metrics import StepTotals, add_first_pass, add_micro_batch


def micro_batch_loss(
    policy: torch.Tensor,
    *,
    share: float,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """The loss a micro-batch backpropagates (scalars throughout): its `policy` loss, already normalised
    by the whole update's denominator, less `entropy_coef` × its entropy and plus `kl_coef` × its k3 KL
    (GRPO, arXiv 2402.03300, Eq. 3). Entropy and KL are token means of this micro-batch, so each is
    weighted by the micro-batch's `share` of the update's trainable tokens; None leaves a term out."""
    loss = policy
    if entropy is not None:
        loss = loss - entropy_coef * entropy * share
    if kl is not None:
        loss = loss + kl_coef * kl * share
    return loss


@dataclass(frozen=True)
class _Update:
    """What every micro-batch of one update shares."""

    prepared: PreparedBatch
    proximal: list[torch.Tensor] | None
    """Log-probs before the step's first update, one `[T-1]` row per trajectory; None: not needed."""
    denominator: float
    """The whole mini-batch's loss denominator (`LossInputs.denominator`)."""
    tokens: int
    """The whole mini-batch's trainable tokens."""
    threshold: torch.Tensor | None
    """SAT's quantile over the whole mini-batch; None: one micro-batch holds it, or SAT is off."""
    first_epoch: bool
    """Whether the engine-vs-trainer figures are taken (each trajectory once)."""
    version: int
    """The trainer's policy version (`mismatch_fresh` counts the tokens the engine generated at it)."""
    totals: StepTotals


@dataclass(frozen=True)
class UpdateStep:
    """Runs optimizer updates of the scorer's model, each on one mini-batch (see the module docstring)."""

    scorer: Scorer
    """The trained model's forward (R3 replay, temperature, device)."""
    optimizer: torch.optim.Optimizer
    ranks: Ranks
    loss: PolicyLoss
    """The policy loss, resolved once."""
    settings: Any
    """The policy loss's own knobs (`LossConfig.settings`), resolved once."""
    config: LossConfig
    """Clip, SAT, entropy and KL settings."""
    grad_clip: float
    """The gradient-norm clip."""
    micro_batch_size: int
    """Sequences per forward/backward (whole groups)."""
    reference: nn.Module | None = None
    """The frozen KL reference (None: no KL term)."""

    def run(
        self,
        prepared: PreparedBatch,
        members: list[int],
        proximal: list[torch.Tensor] | None,
        *,
        moved: bool,
        first_epoch: bool,
        version: int,
        totals: StepTotals,
    ) -> tuple[str, float]:
        """One optimizer update on `members` (positions in `prepared`); returns (skip reason or "", the
        gradient norm). `moved`: an update of this step was applied already, so the weights are no longer
        those of the `proximal` pass. The step's figures are added to `totals`."""
        chunks = micro_batches(prepared.group_index, members, self.micro_batch_size)
        trajectories = [prepared.trajectories[i] for i in members]
        unit = self.loss.mean_unit(self.settings)
        tokens = sum(t.num_model_tokens for t in trajectories)
        denominator = float(tokens if unit == "token" else len(trajectories))
        # This rank's micro-batches (all of them in one process), collated once: SAT's quantile pass and
        # the training pass read the same batches.
        mine = self.ranks.share(chunks)
        batches = [self.scorer.collate([prepared.trajectories[i] for i in chunk]) for chunk, _ in mine]
        threshold = self._sat_threshold(len(chunks), mine, batches, proximal, moved)
        update = _Update(prepared, proximal, denominator, tokens, threshold, first_epoch, version, totals)
        self.optimizer.zero_grad(set_to_none=True)
        for (chunk, counted), batch in zip(mine, batches, strict=True):
            reason = self._accumulate(update, chunk, batch, counted)
            if reason:
                return reason, 0.0
        parameters = self.scorer.model.parameters()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, self.grad_clip))
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
        measure, sat = self.loss.sat, sat_config(self.config)
        if sat is None or measure is None or count < 2:
            return None
        values: list[torch.Tensor] = []
        for (chunk, counted), batch in zip(mine, batches, strict=True):
            if proximal is not None and not moved:  # the weights of the proximal pass are these
                current = padded([proximal[i] for i in chunk], batch.loss_mask.shape)
            else:
                with torch.no_grad():
                    current, _, _ = self.scorer.forward(batch)
            mask, behaviour = batch.loss_mask, batch.behaviour.to(current.dtype)
            if not counted:
                continue
            if measure == "sequence":
                values.append(sequence_staleness(current, behaviour, mask)[mask.any(-1)])
            else:
                values.append((current - behaviour)[mask])
        if self.ranks.size > 1:
            values = [
                part.to(self.scorer.device)
                for parts in self.ranks.gather([v.cpu() for v in values])
                for part in parts
            ]
        staleness = torch.cat(values)
        return sat_threshold(staleness, torch.ones_like(staleness, dtype=torch.bool), sat)

    def _accumulate(self, update: _Update, chunk: list[int], batch: TokenBatch, counted: bool) -> str:
        """Forward and backward one micro-batch (positions `chunk`), its loss normalised by the whole
        mini-batch; returns a skip reason or "" (the same on every rank). `counted` False: another rank's
        micro-batch run only so that this rank enters the same collectives; its gradient is multiplied by
        0 and its figures dropped."""
        logprobs, logits, stats = self.scorer.forward(batch)
        mask = batch.loss_mask
        finite = bool(torch.isfinite(logprobs[mask]).all())
        if self.ranks.agree("" if finite else "nonfinite_logprobs"):
            return "nonfinite_logprobs"
        prepared, proximal = update.prepared, update.proximal
        advantages = torch.tensor(
            [prepared.advantages[i] for i in chunk], dtype=logprobs.dtype, device=logprobs.device
        )
        groups = torch.tensor(
            [prepared.group_index[i] for i in chunk], dtype=torch.long, device=logprobs.device
        )
        anchor = logprobs.detach() if proximal is None else padded([proximal[i] for i in chunk], mask.shape)
        inputs = LossInputs(
            logprobs=logprobs,
            proximal=anchor,
            behaviour=batch.behaviour.to(logprobs.dtype),
            advantages=advantages,
            mask=mask,
            groups=groups,
            sat_threshold=update.threshold,
            denominator=update.denominator,
        )
        output = self.loss.compute(inputs, self.config)
        chunk_tokens = batch.num_tokens
        share = chunk_tokens / update.tokens
        temperature = self.scorer.temperature
        entropy_coef, kl_coef = self.config.entropy_coef, self.config.kl_coef
        entropy = entropy_from_logits(logits, mask, temperature) if entropy_coef else None
        kl = self._kl(logprobs, batch)
        loss = micro_batch_loss(
            output.loss, share=share, entropy=entropy, entropy_coef=entropy_coef, kl=kl, kl_coef=kl_coef
        )
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
                entropy = entropy_from_logits(logits, mask, temperature)
            # The shares' own entries: tokens (grpo, decoupled_ppo), sequences (gspo), groups (gmc).
            units = {"token": chunk_tokens, "group": len(set(groups.tolist())), "sequence": len(chunk)}
            add_micro_batch(
                update.totals,
                output,
                entropy=entropy,
                kl=kl,
                share=share,
                tokens=chunk_tokens,
                entries=units[self.loss.entries],
            )
            if update.first_epoch:
                add_first_pass(update.totals, logprobs, batch, stats, update.version)
        return ""

    def _kl(self, logprobs: torch.Tensor, batch: TokenBatch) -> torch.Tensor | None:
        """The k3 KL of the micro-batch's log-probs `[B, T-1]` to the reference's (None without one)."""
        if self.reference is None:
            return None
        with torch.no_grad():
            reference, _, _ = forward_logprobs(
                self.reference,
                batch,
                temperature=self.scorer.temperature,
                replay_routes=self.scorer.replay_routes,
            )
        return kl_k3(logprobs, reference, batch.loss_mask)
