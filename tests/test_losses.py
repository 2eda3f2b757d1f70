"""Advantages and losses against numbers worked out by hand (two or three sequences)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.advantages import dr_grpo_advantages, grpo_advantages, reinforce_pp_baseline_advantages
from trainer.losses import ClipConfig, SATConfig, grpo_loss, gspo_loss, sat_bounds


def test_advantages_by_hand() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    # group 1: mean 0.5, population std 0.5 -> +-1; group 2: no variance -> 0
    assert grpo_advantages(rewards).tolist() == [[1.0, -1.0, -1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    assert dr_grpo_advantages(rewards).tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]
    # centred [.5,-.5,-.5,.5,0,0,0,0]: mean 0, population std sqrt(1/8) -> x * sqrt(8)
    expected = [[0.5 * math.sqrt(8), -0.5 * math.sqrt(8)] * 2, [0.0] * 4]
    reinforce = reinforce_pp_baseline_advantages(rewards)
    assert reinforce[0].tolist() == pytest.approx(
        [expected[0][0], expected[0][1], expected[0][1], expected[0][0]]
    )
    with pytest.raises(ValueError, match="NaN"):
        grpo_advantages(torch.tensor([[1.0, float("nan")]]))


def test_grpo_clipped_surrogate_by_hand() -> None:
    # sequence 1: tokens with ratios 1.5 and 0.5, advantage +1; sequence 2: one token, ratio 1.5, A = -1
    old = torch.zeros(2, 2)
    new = torch.log(torch.tensor([[1.5, 0.5], [1.5, 1.0]]))
    mask = torch.tensor([[True, True], [True, False]])
    advantages = torch.tensor([1.0, -1.0])
    out = grpo_loss(new, old, advantages, mask, ClipConfig(0.2, 0.2))
    # seq 1: -min(1.5, 1.2) = -1.2 and -min(0.5, 0.8) = -0.5 -> mean -0.85; seq 2: -min(-1.5, -1.2) = 1.5
    assert out.loss.item() == pytest.approx((-0.85 + 1.5) / 2)
    assert out.clip_fraction.item() == pytest.approx(1 / 3)  # only the 1.5 ratio with A = +1 is clipped
    token = grpo_loss(new, old, advantages, mask, ClipConfig(0.2, 0.2), aggregation="token")
    assert token.loss.item() == pytest.approx((-1.2 - 0.5 + 1.5) / 3)
    dapo = grpo_loss(new, old, advantages, mask, ClipConfig(0.2, 0.28))  # asymmetric: 1.5 clipped at 1.28
    assert dapo.loss.item() == pytest.approx(((-1.28 - 0.5) / 2 + 1.5) / 2)


def test_gspo_sequence_ratio_by_hand() -> None:
    old = torch.zeros(2, 2)
    new = torch.tensor([[0.1, 0.3], [-0.5, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    advantages = torch.tensor([1.0, -1.0])
    out = gspo_loss(new, old, advantages, mask, ClipConfig(0.2, 0.2))
    # s_1 = e^0.2 = 1.2214 -> min(1.2214, 1.2) = 1.2; s_2 = e^-0.5 = 0.6065 -> min(-0.6065, -0.8) = -0.8
    assert out.loss.item() == pytest.approx(-(1.2 - 0.8) / 2)
    assert out.clip_fraction.item() == 1.0
    token = gspo_loss(new, old, advantages, mask, ClipConfig(0.2, 0.2), token_level=True)
    assert token.loss.item() == pytest.approx(out.loss.item())


def test_gspo_token_has_the_gspo_gradient() -> None:
    old = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    advantages = torch.tensor([0.7, -0.3])
    start = torch.tensor([[0.01, -0.02, 0.03], [0.02, -0.01, 0.0]])
    grads = []
    for token_level in (False, True):
        new = start.clone().requires_grad_(True)
        gspo_loss(new, old, advantages, mask, ClipConfig(0.2, 0.2), token_level=token_level).loss.backward()
        assert new.grad is not None
        grads.append(new.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-7)


def test_sat_bounds_at_the_quantile_by_hand() -> None:
    d = torch.tensor([0.01, -0.02, 0.5, -0.6, 0.03])
    active = torch.ones(5, dtype=torch.bool)
    lo, hi, gated, k = sat_bounds(d, active, ClipConfig(0.2, 0.2), SATConfig(quantile=0.9))
    # sorted |d| = [.01,.02,.03,.5,.6]; q(0.9) = .5 + .6 * (.6 - .5) = .56; only |-0.6| > .56 is gated
    q = 0.56
    contraction = 1 / (1 + ((0.6 - q) / q) ** 2)
    assert gated.tolist() == [False, False, False, True, False]
    assert lo.tolist() == pytest.approx([0.8, 0.8, 0.8, 1 - 0.2 * contraction, 0.8])
    assert hi.tolist() == pytest.approx([1.2] * 5)  # d < 0: only the lower endpoint contracts
    assert k[3].item() == pytest.approx(contraction)
    _, hi_up, _, _ = sat_bounds(-d, active, ClipConfig(0.2, 0.2), SATConfig(quantile=0.9))
    assert hi_up[3].item() == pytest.approx(1 + 0.2 * contraction)  # d > 0: only the upper one
    _, _, _, k_rational = sat_bounds(
        d, active, ClipConfig(0.2, 0.2), SATConfig(quantile=0.9, kernel="rational")
    )
    assert k_rational[3].item() == pytest.approx(2 * q**2 / (q**2 + 0.6**2))


def test_sat_passes_pull_back_updates_and_reduces_to_the_base_loss() -> None:
    mask = torch.ones(1, 4, dtype=torch.bool)
    behaviour = torch.zeros(1, 4)
    # token 3 has drifted far below the behaviour policy (d = -0.6 -> gated, lower end contracted)
    start = torch.tensor([[0.01, -0.02, 0.03, -0.6]])
    for advantage, pull_back in ((1.0, True), (-1.0, False)):
        grads = []
        for sat in (None, SATConfig(quantile=0.5)):
            new = start.clone().requires_grad_(True)
            grpo_loss(new, behaviour, torch.tensor([advantage]), mask, sat=sat).loss.backward()
            assert new.grad is not None
            grads.append(new.grad[0, 3].item())
        if pull_back:  # A > 0 pushes r back up toward 1: SAT leaves the gradient alone
            assert grads[0] == pytest.approx(grads[1]) and grads[0] != 0
        else:  # A < 0 would push r further out: both clip (r = 0.55 is below 0.8 and below SAT's bound)
            assert grads[0] == 0 and grads[1] == 0
    # Nothing gated (all |d| equal, none above the quantile): SAT equals the base loss.
    equal = torch.tensor([[0.1, -0.1, 0.1, -0.1]])
    base = grpo_loss(equal, behaviour, torch.tensor([1.0]), mask)
    gated = grpo_loss(equal, behaviour, torch.tensor([1.0]), mask, sat=SATConfig())
    assert gated.loss.item() == base.loss.item() and gated.gate_rate.item() == 0.0


def test_sat_is_pessimistic_on_a_gated_outward_band() -> None:
    # |d| = .01 .02 .03 .15, q(0.5) = .025: tokens 3 and 4 are gated. Token 4: k = 1/(1 + 5^2) = 1/26,
    # hi = 1 + 0.2/26 = 1.0077 < r = e^0.15 = 1.1618, so SAT clips where PPO (hi 1.2) would not.
    mask = torch.ones(1, 4, dtype=torch.bool)
    new = torch.tensor([[0.01, 0.02, 0.03, 0.15]], requires_grad=True)
    out = grpo_loss(
        new, torch.zeros(1, 4), torch.tensor([1.0]), mask, ClipConfig(0.2, 0.2), sat=SATConfig(0.5)
    )
    out.loss.backward()
    assert new.grad is not None and new.grad[0, 3].item() == 0.0
    assert new.grad[0, 2].item() != 0.0  # token 3 is gated too, but r = 1.03 stays inside 1 + 0.2/1.04
    assert out.gate_rate.item() == 0.5
    assert out.mean_contraction.item() == pytest.approx((1 / 26 + 1 / 1.04) / 2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mask": torch.ones(2, 2)}, "mask must be a bool"),
        ({"advantages": torch.zeros(3)}, r"advantages must be \[B\]"),
        ({"logprobs": torch.tensor([[float("nan"), 0.0], [0.0, 0.0]])}, "NaN or inf"),
        ({"old_logprobs": torch.zeros(2, 3)}, "must share a"),
    ],
)
def test_bad_batches_are_refused(kwargs: dict[str, torch.Tensor], message: str) -> None:
    batch = {
        "logprobs": torch.zeros(2, 2),
        "old_logprobs": torch.zeros(2, 2),
        "advantages": torch.zeros(2),
        "mask": torch.ones(2, 2, dtype=torch.bool),
    } | kwargs
    with pytest.raises(ValueError, match=message):
        grpo_loss(**batch)
