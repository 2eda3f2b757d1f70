"""A learner step's figures by hand: weighted means over micro-batches, a micro-batch's loss terms, and
the figures of the batch and of its updates."""

from __future__ import annotations

import pytest
import torch

from pacerl.trainer.distributed import Ranks
from pacerl.trainer.losses import LossOutput
from pacerl.trainer.step_metrics import (
    FIRST_PASS,
    PER_TOKEN,
    PER_UNIT,
    StepTotals,
    add_micro_batch,
    batch_figures,
    mean,
    update_figures,
)
from pacerl.trainer.update_step import micro_batch_loss
from tests.trainer.helpers import make_trajectory


def loss_output(loss: float, clip_fraction: float) -> LossOutput:
    return LossOutput(
        loss=torch.tensor(loss),
        clip_fraction=torch.tensor(clip_fraction),
        gate_rate=torch.tensor(0.5),
        sat_active=torch.tensor(0.25),
        mean_contraction=torch.tensor(0.75),
    )


def test_totals_weigh_each_figure_by_what_it_is_a_mean_of() -> None:
    totals = StepTotals()
    # Two micro-batches of 3 and 1 trainable tokens, each holding that share of its update's 4 tokens;
    # their shares count 2 and 6 sequences.
    add_micro_batch(
        totals, loss_output(0.75, 0.5), entropy=torch.tensor(2.0), kl=None, share=0.75, tokens=3, entries=2
    )
    add_micro_batch(
        totals,
        loss_output(0.5, 0.0),
        entropy=torch.tensor(6.0),
        kl=torch.tensor(0.4),
        share=0.25,
        tokens=1,
        entries=6,
    )
    means = totals.means()
    assert list(means) == [*PER_TOKEN, *PER_UNIT, *FIRST_PASS]
    # Each micro-batch's loss as a mean of its own tokens: 0.75 / 0.75 = 1 and 0.5 / 0.25 = 2.
    assert means["loss"] == pytest.approx((1.0 * 3 + 2.0 * 1) / 4)
    assert means["entropy"] == pytest.approx((2.0 * 3 + 6.0 * 1) / 4)
    assert means["kl"] == pytest.approx(0.4 / 4)
    assert means["clip_fraction"] == pytest.approx(0.5 * 2 / 8)
    assert means["sat_gate_rate"] == pytest.approx(0.5)
    assert means["mismatch"] == 0.0  # nothing added: 0, not a division by 0
    assert totals.summed_over(Ranks()) is totals


def test_a_micro_batch_loss_weighs_entropy_and_kl_by_its_share_of_tokens() -> None:
    policy = torch.tensor(0.5)
    assert float(micro_batch_loss(policy, share=0.25)) == 0.5
    both = micro_batch_loss(
        policy, share=0.25, entropy=torch.tensor(2.0), entropy_coef=0.1, kl=torch.tensor(0.8), kl_coef=0.5
    )
    assert float(both) == pytest.approx(0.5 - 0.1 * 2.0 * 0.25 + 0.5 * 0.8 * 0.25)  # 0.55
    assert float(
        micro_batch_loss(policy, share=0.5, entropy=torch.tensor(2.0), entropy_coef=0.1)
    ) == pytest.approx(0.4)


def test_batch_and_update_figures_by_hand() -> None:
    trajectories = [
        make_trajectory("a/0", "a", 1.0, [20, 21, 22]),
        make_trajectory("a/1", "a", 0.0, [23]),
        make_trajectory("b/0", "b", 0.5, [24, 25]),
    ]
    figures = batch_figures([trajectories[:2], trajectories[2:]])
    assert figures == {"reward": pytest.approx(0.5), "accuracy": pytest.approx(1 / 3), "trajectories": 3.0}
    updates = update_figures([1.0, 3.0], ["nonfinite_grad"], trajectories, planned_updates=3, elapsed=2.0)
    assert updates == {
        "grad_norm": 2.0,
        "updates": 2.0,
        "skipped_updates": 1.0,
        "tokens": 6.0,
        "trained_trajectories": 3.0,
        "step_s": 2.0,
        "tokens_per_s": 6.0 * 3 / 2.0,
    }
    assert mean([]) == 0.0 and batch_figures([])["reward"] == 0.0
