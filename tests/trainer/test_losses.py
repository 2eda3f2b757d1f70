"""Advantages and losses against numbers worked out by hand (two or three sequences)."""

from __future__ import annotations

import math
import re
from contextlib import AbstractContextManager
from typing import Literal

import pytest
import torch

from pacerl.trainer.advantages import dr_grpo_advantages, grpo_advantages, reinforce_pp_baseline_advantages
from pacerl.trainer.losses import (
    ClipConfig,
    SATConfig,
    decoupled_ppo_loss,
    entropy_from_logits,
    gmc_loss,
    grpo_loss,
    gspo_loss,
    kl_k3,
    sat_bounds,
    sat_threshold,
    sequence_staleness,
    token_logprobs,
)

NAN = float("nan")


def _close(actual: torch.Tensor, expected: float | list[float] | list[list[float]]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=1e-6, atol=1e-6)


def test_advantages_by_hand() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    # group 1: mean 0.5, population std 0.5 -> +-1; group 2: no variance -> 0
    assert grpo_advantages(rewards).tolist() == [[1.0, -1.0, -1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    assert dr_grpo_advantages(rewards).tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]
    # unbiased (verl): std sqrt((4 * 0.25) / 3) = 0.57735 -> +-0.866; a lone member has no std -> 0
    unbiased = grpo_advantages(rewards, unbiased=True)
    _close(unbiased, [[0.8660254, -0.8660254, -0.8660254, 0.8660254], [0.0] * 4])
    assert grpo_advantages(torch.tensor([[3.0]]), unbiased=True).tolist() == [[0.0]]
    assert grpo_advantages(torch.tensor([[1.0, 0.0, 0.0]]), unbiased=True)[0, 0].item() == pytest.approx(
        (2 / 3) / math.sqrt((4 / 9 + 2 / 9) / 2)
    )
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


def test_decoupled_ppo_is_ppo_clip_when_the_proximal_policy_is_the_behaviour_one() -> None:
    # The grpo test's batch, anchored at non-zero log-probs: ratios 1.5, 0.5 (A = +1) and 1.5 (A = -1);
    # prox == behav gives w = 1 in every mode.
    anchor = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    new = anchor + torch.log(torch.tensor([[1.5, 0.5], [1.5, 1.0]]))
    mask = torch.tensor([[True, True], [True, False]])
    advantages = torch.tensor([1.0, -1.0])
    for mode in ("none", "mask", "truncate"):
        out = decoupled_ppo_loss(new, anchor, anchor, advantages, mask, behaviour_weight=mode)
        # -min(1.5, 1.2) = -1.2, -min(0.5, 0.8) = -0.5, -min(-1.5, -1.2) = 1.5 over 3 tokens
        _close(out.loss, (-1.2 - 0.5 + 1.5) / 3)
        _close(out.clip_fraction, 1 / 3)
        assert out.masked_fraction.item() == 0.0
        per_sequence = decoupled_ppo_loss(
            new, anchor, anchor, advantages, mask, behaviour_weight=mode, aggregation="sequence"
        )
        _close(per_sequence.loss, ((-1.2 - 0.5) / 2 + 1.5) / 2)
        _close(per_sequence.loss, grpo_loss(new, anchor, advantages, mask).loss.item())


def test_decoupled_ppo_behaviour_weights_by_hand() -> None:
    # prox = 0, so u = exp(logp); w = exp(prox - behav) = exp(-behav). The third token of sequence 2 is
    # padding and holds NaN everywhere.
    u = torch.tensor([[1.1, 1.5, 0.9], [1.5, 0.7, NAN]])
    w = torch.tensor([[1.0, 2.0, 8.0], [0.5, 4.0, NAN]])
    proximal = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, NAN]])
    behaviour = -torch.log(w)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    advantages = torch.tensor([1.0, -1.0])
    # pg, clip [0.8, 1.2]: A = +1: -1.1, -min(1.5, 1.2) = -1.2 (clipped), -0.9;
    #                      A = -1: max(1.5, 1.2) = 1.5, max(0.7, 0.8) = 0.8 (clipped)  -> 2 of 5 clipped
    results = {}
    for mode in ("none", "mask", "truncate"):
        new = torch.log(u).requires_grad_(True)
        out = decoupled_ppo_loss(
            new, proximal, behaviour, advantages, mask, behaviour_weight=mode, weight_cap=5
        )
        out.loss.backward()
        assert new.grad is not None and bool(torch.isfinite(new.grad).all())
        _close(out.clip_fraction, 2 / 5)
        results[mode] = (out, new.grad)
    # none: w = 1 -> (-1.1 - 1.2 - 0.9 + 1.5 + 0.8) / 5
    _close(results["none"][0].loss, -0.9 / 5)
    # mask: w = 8 > 5 drops that token but it stays in the count:
    # (-1.1·1 - 1.2·2 + 0 + 1.5·0.5 + 0.8·4) / 5 = (-1.1 - 2.4 + 0.75 + 3.2) / 5 = 0.45 / 5
    _close(results["mask"][0].loss, 0.09)
    _close(results["mask"][0].masked_fraction, 1 / 5)
    # truncate: w = min(8, 5) = 5 -> (-1.1 - 2.4 - 0.9·5 + 0.75 + 3.2) / 5 = -4.05 / 5
    _close(results["truncate"][0].loss, -0.81)
    assert results["truncate"][0].masked_fraction.item() == 0.0
    # d/dlogp of -A·u·w/5 is -A·u·w/5 on unclipped tokens and 0 on clipped, dropped or padded ones:
    # truncate: -1.1/5, 0, -0.9·5/5 | 1.5·0.5/5, 0, 0; mask: the w = 8 token's gradient is 0.
    _close(results["truncate"][1], [[-0.22, 0.0, -0.9], [0.15, 0.0, 0.0]])
    _close(results["mask"][1], [[-0.22, 0.0, 0.0], [0.15, 0.0, 0.0]])
    by_sequence = decoupled_ppo_loss(
        torch.log(u), proximal, behaviour, advantages, mask, weight_cap=5, aggregation="sequence"
    )
    # (-1.1 - 2.4 + 0) / 3 and (0.75 + 3.2) / 2, then the mean of the two
    _close(by_sequence.loss, ((-1.1 - 2.4) / 3 + (0.75 + 3.2) / 2) / 2)
    # dual clip c = 1.3 caps the A = -1, u = 1.5 token at 1.3·|A|; the A = +1 tokens are untouched
    dual = decoupled_ppo_loss(
        torch.log(u), proximal, behaviour, advantages, mask, behaviour_weight="none", dual_clip=1.3
    )
    _close(dual.loss, (-1.1 - 1.2 - 0.9 + 1.3 + 0.8) / 5)


def test_decoupled_ppo_weight_cap_boundary_by_hand() -> None:
    # u = 1 and A = +1, so pg = -1 on each token; w = 1, exactly 2 (= the cap) and 2·e^0.001 = 2.002001.
    new = torch.zeros(1, 3)
    behaviour = torch.tensor([[0.0, -math.log(2), -(math.log(2) + 1e-3)]])
    assert torch.exp(-behaviour)[0, 1].item() == 2.0
    mask = torch.ones(1, 3, dtype=torch.bool)
    advantages = torch.tensor([1.0])

    def run(mode: Literal["none", "mask", "truncate"], cap: float | None) -> tuple[float, float]:
        out = decoupled_ppo_loss(new, new, behaviour, advantages, mask, behaviour_weight=mode, weight_cap=cap)
        return out.loss.item(), out.masked_fraction.item()

    # mask: w = 2 is kept (only w > cap is dropped), w = 2.002 is dropped: -(1 + 2 + 0) / 3
    assert run("mask", 2.0) == pytest.approx((-1.0, 1 / 3))
    # truncate: both weights at and above the cap count 2: -(1 + 2 + 2) / 3
    assert run("truncate", 2.0) == pytest.approx((-5 / 3, 0.0))
    # no cap: w applied as is: -(1 + 2 + 2.002001) / 3
    assert run("mask", None) == pytest.approx((-(3 + 2 * math.exp(1e-3)) / 3, 0.0))
    assert run("none", 2.0) == pytest.approx((-1.0, 0.0))


def test_decoupled_ppo_takes_sat_bounds_from_the_behaviour_policy() -> None:
    # d = logp - behav = .01 .02 .03 .15 -> q(0.5) = .025, tokens 3 and 4 gated; token 4: k = 1/26, so
    # hi = 1 + 0.2/26 = 1.0077. prox = logp on tokens 1-3 and 0 on token 4: u = 1, 1, 1, e^0.15 = 1.1618.
    new = torch.tensor([[0.01, 0.02, 0.03, 0.15]], requires_grad=True)
    proximal = torch.tensor([[0.01, 0.02, 0.03, 0.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    out = decoupled_ppo_loss(
        new,
        proximal,
        torch.zeros(1, 4),
        torch.tensor([1.0]),
        mask,
        behaviour_weight="none",
        sat=SATConfig(0.5),
    )
    out.loss.backward()
    assert new.grad is not None and new.grad[0, 3].item() == 0.0  # 1.1618 > 1.0077: clipped
    _close(new.grad[0, :3], [-0.25, -0.25, -0.25])  # u = 1 inside: d(-u)/dlogp / 4 tokens
    _close(out.gate_rate, 0.5)
    _close(out.mean_contraction, (1 / 26 + 1 / 1.04) / 2)
    plain = decoupled_ppo_loss(
        new, proximal, torch.zeros(1, 4), torch.tensor([1.0]), mask, behaviour_weight="none"
    )
    _close(plain.loss, -(3 + math.exp(0.15)) / 4)  # without SAT, 1.1618 < 1.2 stays unclipped


def test_gmc_caps_only_the_group_over_its_mass_by_hand() -> None:
    # log π_θ - log μ per token (μ = 0); padding holds NaN. Groups by id: 7 = sequences 0-1, 3 = 2-3.
    new = torch.tensor([[0.1, 0.3], [-0.2, NAN], [0.5, 0.7], [0.4, NAN]], requires_grad=True)
    behaviour = torch.tensor([[0.0, 0.0], [0.0, NAN], [0.0, 0.0], [0.0, NAN]])
    mask = torch.tensor([[True, True], [True, False], [True, True], [True, False]])
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    groups = torch.tensor([7, 7, 3, 3])
    out = gmc_loss(new, behaviour, advantages, mask, groups, eps=0.2)
    # length-normalised ρ: e^0.2 = 1.2214028, e^-0.2 = 0.8187308 (sum 2.0401335 < C = 2·1.2 = 2.4: scale 1);
    # e^0.6 = 1.8221188, e^0.4 = 1.4918247 (sum 3.3139435 > 2.4: scale = 2.4 / 3.3139435 = 0.7242127)
    rho = [math.exp(0.2), math.exp(-0.2), math.exp(0.6), math.exp(0.4)]
    scale = 2.4 / (rho[2] + rho[3])
    # -(1/4)·[1.2214028 - 0.8187308 + 0.7242127·(1.8221188 - 1.4918247)] = -0.1604688
    _close(out.loss, -(rho[0] - rho[1] + scale * (rho[2] - rho[3])) / 4)
    _close(out.clip_fraction, 0.5)
    out.loss.backward()
    # d/dlogp_t = -(1/4)·scale·ρ_i·A_i / |y_i| with the scale held fixed:
    # seq 0: -1.2214028/8 = -0.1526753; seq 1: +0.8187308/4 = 0.2046827;
    # seq 2: -0.7242127·1.8221188/8 = -0.1649502; seq 3: +0.7242127·1.4918247/4 = 0.2700996
    expected = [
        [-rho[0] / 8, -rho[0] / 8],
        [rho[1] / 4, 0.0],
        [-scale * rho[2] / 8, -scale * rho[2] / 8],
        [scale * rho[3] / 4, 0.0],
    ]
    assert new.grad is not None
    _close(new.grad, expected)
    # The group under the cap alone is the plain IS-weighted policy gradient: -(ρ_0·1 - ρ_1) / 2
    alone = gmc_loss(new[:2], behaviour[:2], advantages[:2], mask[:2], groups[:2])
    _close(alone.loss, -(rho[0] - rho[1]) / 2)
    assert alone.clip_fraction.item() == 0.0


def test_gmc_trajectory_ratio_without_length_normalisation_by_hand() -> None:
    new = torch.tensor([[0.1, 0.3], [-0.2, 0.0], [0.5, 0.7], [0.4, 0.0]])
    mask = torch.tensor([[True, True], [True, False], [True, True], [True, False]])
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    groups = torch.tensor([0, 0, 1, 1])
    out = gmc_loss(new, torch.zeros(4, 2), advantages, mask, groups, length_normalized=False)
    # ρ = e^0.4 = 1.4918247, e^-0.2 = 0.8187308 (sum 2.3105555 < 2.4: scale 1);
    # e^1.2 = 3.3201169, e^0.4 = 1.4918247 (sum 4.8119416: scale 2.4 / 4.8119416 = 0.4987592)
    scale = 2.4 / (math.exp(1.2) + math.exp(0.4))
    # -(1/4)·[1.4918247 - 0.8187308 + 0.4987592·(3.3201169 - 1.4918247)] = -0.3962429
    _close(out.loss, -(math.exp(0.4) - math.exp(-0.2) + scale * (math.exp(1.2) - math.exp(0.4))) / 4)
    # ρ = e^100 overflows float32, but the capped weight C·ρ_i/Σρ_j does not: 2.4 and 2.4·e^-100 ≈ 0
    huge = gmc_loss(
        torch.tensor([[100.0], [0.0]]),
        torch.zeros(2, 1),
        torch.tensor([1.0, -1.0]),
        torch.ones(2, 1, dtype=torch.bool),
        torch.tensor([0, 0]),
        length_normalized=False,
    )
    _close(huge.loss, -(2.4 - 0.0) / 2)


def test_kl_k3_by_hand() -> None:
    logprobs = torch.log(torch.tensor([[0.5, 0.25], [0.5, NAN]])).requires_grad_(True)
    reference = torch.log(torch.tensor([[0.25, 0.5], [0.5, NAN]]))
    mask = torch.tensor([[True, True], [True, False]])
    assert kl_k3(reference, reference, mask).item() == 0.0
    kl = kl_k3(logprobs, reference, mask)
    # δ = ref - logp = -ln 2, ln 2, 0: (0.5 + ln 2 - 1) + (2 - ln 2 - 1) + 0 = 0.5 over 3 tokens
    _close(kl, 0.5 / 3)
    kl.backward()
    # d/dlogp (e^δ - δ - 1) = 1 - e^δ: 1 - 0.5, 1 - 2, 0 (each / 3); padding gets 0
    assert logprobs.grad is not None
    _close(logprobs.grad, [[0.5 / 3, -1 / 3], [0.0, 0.0]])


def test_kl_k3_is_bounded_per_token() -> None:
    # A log-ratio of 25 gives e^25 - 26 = 7.2e10 unclamped; verl's bound keeps the token at 10.
    logprobs = torch.tensor([[0.0, -1.0]], requires_grad=True)
    reference = torch.tensor([[25.0, -1.0]])
    mask = torch.tensor([[True, True]])
    kl = kl_k3(logprobs, reference, mask)
    _close(kl, (10.0 + 0.0) / 2)
    kl.backward()
    assert logprobs.grad is not None
    _close(logprobs.grad, [[0.0, 0.0]])  # past the bound no gradient; the equal token has none either
    # Just inside the bounds the estimator is unchanged: δ = 2 gives e^2 - 3 = 4.389 < 10.
    _close(kl_k3(torch.tensor([[0.0]]), torch.tensor([[2.0]]), torch.tensor([[True]])), math.exp(2) - 3)
    # A large negative log-ratio is clamped at -20, and e^-20 + 19 is past the token bound: 10.
    _close(kl_k3(torch.tensor([[0.0]]), torch.tensor([[-30.0]]), torch.tensor([[True]])), 10.0)


def test_grpo_sequence_mean_skips_rows_without_tokens() -> None:
    # verl's seq-mean-token-mean: mask [[1], [0]], equal log-probs, advantages [1, 0] gives -1.0 (the
    # one row with a token), not -0.5 (a mean that also counts the empty row).
    logprobs = torch.zeros(2, 1)
    mask = torch.tensor([[True], [False]])
    output = grpo_loss(logprobs, logprobs, torch.tensor([1.0, 0.0]), mask, aggregation="sequence")
    _close(output.loss, -1.0)
    empty = grpo_loss(logprobs, logprobs, torch.tensor([1.0, 0.0]), torch.zeros(2, 1, dtype=torch.bool))
    _close(empty.loss, 0.0)


def test_entropy_by_hand() -> None:
    assert entropy_from_logits(torch.zeros(1, 1, 4), torch.ones(1, 1, dtype=torch.bool)).item() == (
        pytest.approx(math.log(4))
    )
    logits = torch.tensor(
        [
            [[0.0, 0.0, 0.0], [math.log(0.7), math.log(0.2), math.log(0.1)]],
            [[0.0, 0.0, -math.inf], [NAN, NAN, NAN]],
        ],
        requires_grad=True,
    )
    mask = torch.tensor([[True, True], [True, False]])
    entropy = entropy_from_logits(logits, mask)
    # uniform over 3: ln 3 = 1.0986123; peaked: -(0.7 ln 0.7 + 0.2 ln 0.2 + 0.1 ln 0.1) = 0.8018186;
    # a banned token leaves a uniform pair: ln 2 = 0.6931472
    peaked = -(0.7 * math.log(0.7) + 0.2 * math.log(0.2) + 0.1 * math.log(0.1))
    _close(entropy, (math.log(3) + peaked + math.log(2)) / 3)
    entropy.backward()
    assert logits.grad is not None and bool(torch.isfinite(logits.grad).all())
    # temperature 2 flattens softmax([ln 4, 0]) = (0.8, 0.2) to softmax([ln 2, 0]) = (2/3, 1/3)
    hot = entropy_from_logits(torch.tensor([[[math.log(4), 0.0]]]), torch.ones(1, 1, dtype=torch.bool), 2.0)
    _close(hot, -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3)))
    # every token banned: no distribution, so a NaN entropy; not a refusal, which is kept for NaN or +inf
    # logits (the NaN entropy alone must not raise: only then are the rows searched)
    banned = entropy_from_logits(torch.full((1, 1, 3), -math.inf), torch.ones(1, 1, dtype=torch.bool))
    assert bool(torch.isnan(banned))


def test_token_logprobs_by_hand() -> None:
    logits = torch.tensor([[[2 * math.log(2), 0.0, 0.0], [0.0, 2 * math.log(3), 0.0]]])
    targets = torch.tensor([[0, 1]])
    # T = 1: softmax([4, 1, 1]/6) at 0 = 2/3; softmax([1, 9, 1]/11) at 1 = 9/11
    _close(token_logprobs(logits, targets), [[math.log(2 / 3), math.log(9 / 11)]])
    # T = 2 halves the logits: [ln 2, 0, 0] -> 2/4 at 0; [0, ln 3, 0] -> 3/5 at 1
    _close(token_logprobs(logits, targets, temperature=2.0), [[math.log(0.5), math.log(0.6)]])
    assert token_logprobs(logits.bfloat16(), targets).dtype == torch.float32
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, targets, temperature=0.0)
    with pytest.raises(ValueError, match="token ids"):
        token_logprobs(logits, torch.tensor([[0, 3]]))
    with pytest.raises(ValueError, match="integer"):
        token_logprobs(logits, targets.float())


def test_token_logprobs_gradient_by_hand_and_as_autograd_derives_it() -> None:
    """The fused backward (`_TokenLogprobs`): d log p_t / d z_j = (1[j = t] - p_j) / T, times the
    upstream gradient, in the logits' dtype."""
    # softmax(ln [1, 2, 5]) = (1, 2, 5) / 8; row 0 at T = 1, row 1 the same distribution at T = 2.
    logits = torch.log(torch.tensor([[[1.0, 2.0, 5.0], [1.0, 4.0, 25.0]]], dtype=torch.float64))
    logits.requires_grad_(True)
    (token_logprobs(logits[:, :1], torch.tensor([[1]])) * 3.0).sum().backward()
    assert logits.grad is not None
    _close(logits.grad[0, 0], [-3 / 8, 3 * (1 - 2 / 8), -3 * 5 / 8])
    _close(logits.grad[0, 1], [0.0, 0.0, 0.0])
    logits.grad = None
    (token_logprobs(logits[:, 1:], torch.tensor([[2]]), temperature=2.0) * -1.0).sum().backward()
    _close(logits.grad[0, 1], [1 / 8 / 2, 2 / 8 / 2, -(1 - 5 / 8) / 2])
    # On a random batch: the gradient of log_softmax(z / T) gathered at the targets, for any upstream one.
    torch.manual_seed(0)
    for temperature in (1.0, 0.7):
        z = torch.randn(2, 5, 11, dtype=torch.float64, requires_grad=True)
        targets, upstream = torch.randint(0, 11, (2, 5)), torch.randn(2, 5, dtype=torch.float64)
        (fused,) = torch.autograd.grad((token_logprobs(z, targets, temperature) * upstream).sum(), z)
        plain = torch.log_softmax(z / temperature, -1).gather(-1, targets[..., None]).squeeze(-1)
        (expected,) = torch.autograd.grad((plain * upstream).sum(), z)
        assert torch.allclose(fused, expected, rtol=1e-12, atol=1e-14)
    half = torch.zeros(1, 2, 3, dtype=torch.bfloat16, requires_grad=True)
    token_logprobs(half, torch.tensor([[0, 2]])).sum().backward()
    assert half.grad is not None and half.grad.dtype == torch.bfloat16


def _nan_at(row: int, column: int) -> torch.Tensor:
    logprobs = torch.zeros(2, 2)
    logprobs[row, column] = NAN
    return logprobs


@pytest.mark.parametrize("loss", ["decoupled", "gmc", "kl"])
def test_nan_on_a_trainable_token_is_refused_and_on_padding_ignored(loss: str) -> None:
    mask = torch.tensor([[True, True], [True, False]])

    def call(logprobs: torch.Tensor) -> torch.Tensor:
        zeros, advantages = torch.zeros(2, 2), torch.tensor([1.0, -1.0])
        if loss == "decoupled":
            return decoupled_ppo_loss(logprobs, zeros, zeros, advantages, mask).loss
        if loss == "gmc":
            return gmc_loss(logprobs, zeros, advantages, mask, torch.tensor([0, 0])).loss
        return kl_k3(logprobs, zeros, mask)

    with pytest.raises(ValueError, match="logprobs contain NaN"):
        call(_nan_at(0, 1))
    padded = _nan_at(1, 1).requires_grad_(True)
    value = call(padded)
    value.backward()
    assert padded.grad is not None
    assert math.isfinite(value.item()) and bool(torch.isfinite(padded.grad).all())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"group_index": torch.tensor([0.0, 1.0])}, "integer"),
        ({"group_index": torch.tensor([0, 0, 1])}, r"group_index must be \[B\]"),
        ({"behaviour_logprobs": torch.zeros(2, 3)}, "must share a"),
        ({"eps": -0.1}, "eps"),
    ],
)
def test_gmc_bad_batches_are_refused(kwargs: dict[str, object], message: str) -> None:
    batch: dict[str, object] = {
        "logprobs": torch.zeros(2, 2),
        "behaviour_logprobs": torch.zeros(2, 2),
        "advantages": torch.zeros(2),
        "mask": torch.ones(2, 2, dtype=torch.bool),
        "group_index": torch.tensor([0, 1]),
    } | kwargs
    with pytest.raises(ValueError, match=message):
        gmc_loss(**batch)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"weight_cap": 1.0}, "weight_cap"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"behaviour_weight": "clip"}, "behaviour_weight"),
        ({"aggregation": "batch"}, "aggregation"),
    ],
)
def test_decoupled_ppo_bad_settings_are_refused(kwargs: dict[str, object], message: str) -> None:
    zeros, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match=message):
        decoupled_ppo_loss(zeros, zeros, zeros, torch.zeros(1), mask, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["grpo", "gspo", "gspo_token"])
def test_nan_in_padding_leaves_grpo_and_gspo_and_their_gradients_finite(name: str) -> None:
    mask = torch.tensor([[True, True, False]])
    new = torch.tensor([[-1.0, -2.0, float("nan")]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.9, float("nan")]])
    advantages = torch.tensor([1.0])
    if name == "grpo":
        out = grpo_loss(new, old, advantages, mask, sat=SATConfig())
    else:
        out = gspo_loss(new, old, advantages, mask, token_level=name == "gspo_token", sat=SATConfig())
    out.loss.backward()
    assert torch.isfinite(out.loss) and new.grad is not None and torch.isfinite(new.grad).all()
    assert new.grad[0, 2] == 0


# -- Mutation-testing kills (docs/mutation.md): each test pins a behaviour a plausible wrong edit would
# change, with numbers worked out by hand.


def _sat_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprobs, old, behaviour, advantages, mask) for the SAT tests below. Per token: d = log π_θ - log μ
    (μ = -1), r = π_θ/π_old, A per row; SAT's q = 0.2 is given, so |d| = 0.3 is gated with
    k = 1/(1 + ((0.3 - 0.2)/0.2)^2) = 0.8 and bounds [1 - 0.1·c−, 1 + 0.3·c+] (ClipConfig(0.1, 0.3)):
    d > 0 -> hi = 1.24, d < 0 -> lo = 0.92; ungated tokens keep [0.9, 1.3].

    row 0, A = +2: (d +0.3, r 1.25) -> -min(2.5, 2.48) = -2.48, SAT's clip (1.25 < 1.3);
                   (d +0.3, r 1.5)  -> -min(3.0, 2.48) = -2.48, the base clip would bind too
    row 1, A = -2: (d -0.3, r 0.91) -> -min(-1.82, -1.84) = 1.84, SAT's clip (0.91 > 0.9);
                   (d -0.3, r 0.5)  -> -min(-1.0, -1.84) = 1.84, the base clip would bind too
    row 2, A = -2: (d +0.3, r 1.28) -> -min(-2.56, -2.48) = 2.56, gated but a pull-back: unclipped
    row 3, A = 3:  no trainable token (NaN padding)
    row 4, A = +2: (d +0.1, r 1.5)  -> ungated, -min(3.0, 2.6) = -2.6
    """
    d = torch.tensor([[0.3, 0.3], [-0.3, -0.3], [0.3, NAN], [NAN, NAN], [0.1, NAN]])
    r = torch.tensor([[1.25, 1.5], [0.91, 0.5], [1.28, NAN], [NAN, NAN], [1.5, NAN]])
    mask = torch.isfinite(d)
    behaviour = torch.where(mask, -1.0, NAN)
    logprobs = behaviour + d
    return logprobs, logprobs - torch.log(r), behaviour, torch.tensor([2.0, -2.0, -2.0, 3.0, 2.0]), mask


def test_grpo_and_decoupled_ppo_sat_by_hand_with_asymmetric_radii() -> None:
    logprobs, old, behaviour, advantages, mask = _sat_batch()
    clip, sat = ClipConfig(0.1, 0.3), SATConfig()
    # token mean over 6 tokens: (-2.48 - 2.48 + 1.84 + 1.84 + 2.56 - 2.6) / 6 = -1.32 / 6;
    # sequence mean over the 4 rows with tokens: (-2.48 + 1.84 + 2.56 - 2.6) / 4 = -0.68 / 4
    token_sum, sequence_sum = -1.32, -0.68
    cases: list[tuple[Literal["token", "sequence"], float, int]] = [
        ("token", token_sum, 6),
        ("sequence", sequence_sum, 4),
    ]
    for aggregation, total, count in cases:
        for denominator in (None, 2 * count):
            grpo = grpo_loss(
                logprobs,
                old,
                advantages,
                mask,
                clip,
                aggregation,
                sat,
                behaviour,
                sat_threshold=0.2,
                denominator=denominator,
            )
            ppo = decoupled_ppo_loss(
                logprobs,
                old,
                behaviour,
                advantages,
                mask,
                clip,
                behaviour_weight="none",
                aggregation=aggregation,
                sat=sat,
                sat_threshold=0.2,
                denominator=denominator,
            )
            for out in (grpo, ppo):
                assert out.loss.item() == pytest.approx(total / (denominator or count), rel=1e-5)
                assert out.gate_rate.item() == pytest.approx(5 / 6)  # all but the d = 0.1 token
                assert out.clip_fraction.item() == pytest.approx(5 / 6)  # all but the pull-back
                assert out.sat_active.item() == pytest.approx(2 / 6)  # r = 1.25 and r = 0.91 only
                assert out.mean_contraction.item() == pytest.approx(0.8, rel=1e-5)
    # Row by row, SAT acts on one token of row 0 (r 1.25, not 1.5), one of row 1 (r 0.91, not 0.5) and on
    # none of rows 2 (pull-back) and 4 (ungated).
    for row, acted in ((0, 0.5), (1, 0.5), (2, 0.0), (4, 0.0)):
        part = slice(row, row + 1)
        one = grpo_loss(
            logprobs[part],
            old[part],
            advantages[part],
            mask[part],
            clip,
            sat=sat,
            sat_threshold=0.2,
            behaviour_logprobs=behaviour[part],
        )
        assert one.sat_active.item() == acted
    # Without SAT nothing is gated and the mean contraction of no gated token is 1, not a mean of nothing.
    plain = grpo_loss(logprobs, old, advantages, mask, clip)
    assert (plain.gate_rate.item(), plain.mean_contraction.item(), plain.sat_active.item()) == (0, 1, 0)


def test_gspo_sat_gates_on_the_sequence_mean_by_hand() -> None:
    # GSPO's gate reads each sequence's mean of log π_θ - log μ (μ = -1), q = 0.2 given, and clips the
    # sequence ratio s_i (π_old = π_θ/s_i per token); ClipConfig(0.1, 0.3), k(0.3) = 0.8:
    # row 0: d = +0.6, -0.6 -> mean 0, not gated (a token-level gate would gate both tokens);
    #        s 1.25 inside [0.9, 1.3], A = +1: -1.25
    # row 1: d = +0.3, +0.3 -> gated, hi = 1 + 0.3·0.8 = 1.24; s 1.25, A = +1: -1.24 (SAT's clip)
    # row 2: d = -0.3       -> gated, lo = 1 - 0.1·0.8 = 0.92; s 0.91, A = -2: -min(-1.82, -1.84) = 1.84
    # row 3: no trainable token: not in the mean (A = 5 would add -5 to it)
    # row 4: d = +0.3, +0.3 -> gated, hi 1.24; s 1.28, A = -1 pulls back: -min(-1.28, -1.24) = 1.28
    d = torch.tensor([[0.6, -0.6], [0.3, 0.3], [-0.3, NAN], [NAN, NAN], [0.3, 0.3]])
    mask = torch.isfinite(d)
    behaviour = torch.where(mask, -1.0, NAN)
    logprobs = behaviour + d
    old = logprobs - torch.log(torch.tensor([1.25, 1.25, 0.91, 1.0, 1.28]))[:, None]
    advantages = torch.tensor([1.0, 1.0, -2.0, 5.0, -1.0])
    total = -1.25 - 1.24 + 1.84 + 1.28
    for token_level in (False, True):
        for denominator in (None, 8):
            out = gspo_loss(
                logprobs,
                old,
                advantages,
                mask,
                ClipConfig(0.1, 0.3),
                token_level,
                SATConfig(),
                behaviour,
                sat_threshold=0.2,
                denominator=denominator,
            )
            assert out.loss.item() == pytest.approx(total / (denominator or 4), rel=1e-5)
            assert out.gate_rate.item() == 0.75  # rows 1, 2 and 4 of the 4 with tokens
            assert out.clip_fraction.item() == 0.5  # rows 1 and 2
            assert out.sat_active.item() == 0.5  # both clips are SAT's: 1.25 and 0.91 lie in [0.9, 1.3]
            assert out.mean_contraction.item() == pytest.approx(0.8, rel=1e-5)


def test_gspo_sequence_mean_skips_rows_without_tokens() -> None:
    # Rows with log-ratio 0.1 (s = e^0.1 = 1.105, inside the clip) and A = 1, 2; a third row has no
    # trainable token and A = 4: the mean is over the two rows, -(1.105 + 2·1.105) / 2.
    logprobs = torch.tensor([[0.4, 0.6], [-0.4, NAN], [NAN, NAN]])
    old = torch.tensor([[0.3, 0.5], [-0.5, NAN], [NAN, NAN]])
    mask = torch.isfinite(logprobs)
    out = gspo_loss(logprobs, old, torch.tensor([1.0, 2.0, 4.0]), mask)
    assert out.loss.item() == pytest.approx(-3 * math.exp(0.1) / 2, rel=1e-6)


def test_sat_contracts_only_the_endpoint_it_moved_toward_by_the_kernel_radius() -> None:
    # q = 0.2 given, ClipConfig(eps_low 0.1, eps_high 0.3). cauchy k(x) = 1/(1 + ((x - q)/q)^2):
    # k(0.3) = 1/1.25 = 0.8, k(0.6) = 1/(1 + 2^2) = 0.2; rational 2q²/(q² + x²): 0.08/0.13, 0.08/0.4.
    d = torch.tensor([0.3, -0.3, 0.6, -0.1, 0.9])
    active = torch.tensor([True, True, True, True, False])  # the last is padding: never gated
    clip = ClipConfig(0.1, 0.3)
    lo, hi, gated, k = sat_bounds(d, active, clip, SATConfig(), threshold=0.2)
    assert gated.tolist() == [True, True, True, False, False]
    _close(k, [0.8, 0.8, 0.2, 1.0, 1.0])
    _close(lo, [0.9, 1 - 0.1 * 0.8, 0.9, 0.9, 0.9])  # only d < 0 contracts the lower end, by eps_low
    _close(hi, [1 + 0.3 * 0.8, 1.3, 1 + 0.3 * 0.2, 1.3, 1.3])  # only d > 0 the upper end, by eps_high
    _, _, _, rational = sat_bounds(d, active, clip, SATConfig(kernel="rational"), threshold=0.2)
    _close(rational, [0.08 / 0.13, 0.08 / 0.13, 0.08 / 0.4, 1.0, 1.0])
    # A level of 0 gates nothing (q > 0 is part of the gate), and the base interval stays.
    lo, hi, gated, k = sat_bounds(d, active, clip, SATConfig(), threshold=0.0)
    assert (
        not gated.any()
        and lo.tolist() == pytest.approx([0.9] * 5)
        and hi.tolist() == pytest.approx([1.3] * 5)
    )
    # The level is used in the entries' precision: float64 entries, float64 q = 0.2.
    d64 = torch.tensor([0.3, -0.3, 0.6, -0.1, 0.9], dtype=torch.float64)
    k64 = sat_bounds(d64, active, clip, SATConfig(), threshold=0.2)[3]
    assert k64.dtype == torch.float64
    expected = torch.tensor(1 / (1 + ((0.3 - 0.2) / 0.2) ** 2), dtype=torch.float64)
    torch.testing.assert_close(k64[0], expected, rtol=1e-12, atol=0.0)  # a float32 q is off by 5e-8


@pytest.mark.parametrize("threshold", [-0.1, math.inf, NAN, torch.tensor([0.2])])
def test_sat_bounds_refuse_a_bad_threshold(threshold: float | torch.Tensor) -> None:
    d, active = torch.tensor([0.3]), torch.tensor([True])
    with pytest.raises(ValueError, match=r"^threshold must be a finite scalar >= 0, got "):
        sat_bounds(d, active, ClipConfig(), SATConfig(), threshold=threshold)


def test_sat_threshold_ignores_padding_by_hand() -> None:
    # |d| over the active entries = .1 .2 .3: the median is .2; the padding's 5.0 would make it .25.
    d = torch.tensor([0.1, -0.2, 0.3, 5.0])
    active = torch.tensor([True, True, True, False])
    _close(sat_threshold(d, active, SATConfig(quantile=0.5)), 0.2)
    # sat_bounds takes the same level: k(0.3) = 1/(1 + (0.1/0.2)^2) = 0.8 (with .25: 1/1.04)
    _close(sat_bounds(d, active, ClipConfig(), SATConfig(quantile=0.5))[3], [1.0, 1.0, 0.8, 1.0])
    # No active entry: level 0, a scalar in the entries' dtype.
    empty = sat_threshold(d.double(), torch.zeros(4, dtype=torch.bool), SATConfig())
    assert empty.shape == () and empty.item() == 0.0 and empty.dtype == torch.float64
    assert sat_threshold(d.double(), active, SATConfig()).dtype == torch.float64


def test_sequence_staleness_by_hand() -> None:
    # Mean over trainable tokens of log π_θ - log μ; padding may hold NaN; no token -> 0.
    logprobs = torch.tensor([[0.5, 0.1, 0.0], [-0.2, 0.0, 0.0], [0.0, 0.0, 0.0]])
    behaviour = torch.tensor([[0.1, 0.3, NAN], [0.4, NAN, NAN], [NAN, NAN, NAN]])
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    # (0.4 - 0.2) / 2 = 0.1; -0.6 / 1; 0
    _close(sequence_staleness(logprobs, behaviour, mask), [0.1, -0.6, 0.0])


def test_decoupled_ppo_dual_clip_and_default_cap_by_hand() -> None:
    # One token, u = 4, A = -2: pg = -min(-8, -2.4) = 8, and dual_clip c = 3 caps it at c·|A| = 6.
    one = torch.ones(1, 1, dtype=torch.bool)
    dual = decoupled_ppo_loss(
        torch.tensor([[math.log(4)]]),
        torch.zeros(1, 1),
        torch.zeros(1, 1),
        torch.tensor([-2.0]),
        one,
        behaviour_weight="none",
        dual_clip=3.0,
    )
    assert dual.loss.item() == pytest.approx(6.0)
    # The default cap is 5: w = π_prox/π_behav = 5.5 drops the token (it stays in the count: loss 0).
    capped = decoupled_ppo_loss(
        torch.zeros(1, 1), torch.zeros(1, 1), torch.tensor([[-math.log(5.5)]]), torch.tensor([1.0]), one
    )
    assert (capped.loss.item(), capped.masked_fraction.item()) == (0.0, 1.0)


def test_gmc_by_hand_with_behaviour_log_probs_empty_rows_and_the_cap_boundary() -> None:
    # μ ≠ 0: log ρ = mean(-0.9 + 1, -1.8 + 2) = 0.15, ρ = e^0.15 = 1.1618 < C = 1·1.2: uncapped, and the
    # row without trainable tokens is no member of the group (else C = 2.4 and N = 2).
    logprobs = torch.tensor([[-0.9, -1.8], [NAN, NAN]])
    behaviour = torch.tensor([[-1.0, -2.0], [NAN, NAN]])
    mask = torch.isfinite(logprobs)
    out = gmc_loss(logprobs, behaviour, torch.tensor([2.0, 3.0]), mask, torch.tensor([0, 0]))
    assert out.loss.item() == pytest.approx(-2 * math.exp(0.15), rel=1e-6)
    assert out.clip_fraction.item() == 0.0
    part = gmc_loss(logprobs, behaviour, torch.tensor([2.0, 3.0]), mask, torch.tensor([0, 0]), denominator=4)
    assert part.loss.item() == pytest.approx(-2 * math.exp(0.15) / 4, rel=1e-6)
    # eps = 0 is allowed: C = G. Two ratios of exactly 1 reach the cap 2 without passing it: uncapped.
    at_cap = gmc_loss(
        torch.zeros(2, 1),
        torch.zeros(2, 1),
        torch.tensor([2.0, -1.0]),
        torch.ones(2, 1, dtype=torch.bool),
        torch.tensor([5, 5]),
        eps=0.0,
    )
    assert (at_cap.loss.item(), at_cap.clip_fraction.item()) == (-0.5, 0.0)
    # No row with a trainable token: loss 0 with a (zero) gradient, nothing capped, gated or contracted.
    new = torch.zeros(2, 1, requires_grad=True)
    none = gmc_loss(
        new, torch.zeros(2, 1), torch.ones(2), torch.zeros(2, 1, dtype=torch.bool), torch.tensor([0, 1])
    )
    none.loss.backward()
    assert none.loss.item() == 0.0 and new.grad is not None and new.grad.tolist() == [[0.0], [0.0]]
    assert (none.clip_fraction.item(), none.gate_rate.item(), none.mean_contraction.item()) == (0.0, 0.0, 1.0)


def test_gmc_caps_in_float64_by_hand() -> None:
    # log ρ = 0.5, 0.3 (one token each): Σρ = e^0.5 + e^0.3 = 2.99858 > C = 2·1.2 = 2.4, so both are
    # scaled by 2.4/Σρ; the loss is -(2.4/Σρ)·(ρ_0·1 - ρ_1·2)/2, computed in float64 throughout.
    logprobs = torch.tensor([[0.5], [0.3]], dtype=torch.float64)
    out = gmc_loss(
        logprobs,
        torch.zeros_like(logprobs),
        torch.tensor([1.0, -2.0], dtype=torch.float64),
        torch.ones(2, 1, dtype=torch.bool),
        torch.tensor([0, 0]),
    )
    rho = [math.exp(0.5), math.exp(0.3)]
    expected = -(2.4 / sum(rho)) * (rho[0] - 2 * rho[1]) / 2
    assert out.loss.dtype == torch.float64
    torch.testing.assert_close(out.loss, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)
    assert out.clip_fraction.item() == 1.0


def test_kl_k3_far_past_the_bound_keeps_a_finite_gradient() -> None:
    # δ = 100: e^100 overflows float32; clamped at 20 first, the token counts 10 and has no gradient.
    logprobs = torch.tensor([[-100.0]], requires_grad=True)
    kl = kl_k3(logprobs, torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool))
    kl.backward()
    assert kl.item() == 10.0 and logprobs.grad is not None and logprobs.grad.item() == 0.0


def test_advantages_at_their_boundaries_by_hand() -> None:
    pair = torch.tensor([[1.0, 0.0]])
    # G = 2, unbiased: std = sqrt(0.5) -> ±0.5/sqrt(0.5) = ±0.7071068
    _close(grpo_advantages(pair, unbiased=True), [[math.sqrt(0.5), -math.sqrt(0.5)]])
    # population std 0.5 is not above eps = 0.5: no signal; just above eps 0.49 it normalises to ±1
    assert grpo_advantages(pair, eps=0.5).tolist() == [[0.0, 0.0]]
    assert grpo_advantages(pair, eps=0.49).tolist() == [[1.0, -1.0]]
    # REINFORCE++: centred [.5, -.5] has std 0.5 -> ±1 above eps, 0 at it; equal rewards give 0
    assert reinforce_pp_baseline_advantages(pair).tolist() == [[1.0, -1.0]]
    assert reinforce_pp_baseline_advantages(pair, eps=0.5).tolist() == [[0.0, 0.0]]
    assert reinforce_pp_baseline_advantages(torch.ones(2, 3)).tolist() == [[0.0] * 3] * 2


def _refused(message: str) -> AbstractContextManager[pytest.ExceptionInfo[ValueError]]:
    return pytest.raises(ValueError, match="^" + re.escape(message) + "$")


def test_refusals_say_what_is_wrong() -> None:
    """The exact messages: a refusal must name the argument and the values it got."""
    with _refused("rewards must be [groups, G], got shape (3,)"):
        grpo_advantages(torch.zeros(3))
    with _refused("rewards must be [groups, G], got shape (2, 0)"):
        dr_grpo_advantages(torch.zeros(2, 0))
    with _refused("rewards contain NaN or inf"):
        grpo_advantages(torch.tensor([[1.0, math.inf]]))
    with _refused("need 0 < eps_low < 1 and eps_high > 0, got 0.0, 0.2"):
        ClipConfig(0.0, 0.2)
    for eps_low, eps_high in ((1.0, 0.2), (1.5, 0.2), (0.2, 0.0)):
        with _refused(f"need 0 < eps_low < 1 and eps_high > 0, got {eps_low}, {eps_high}"):
            ClipConfig(eps_low, eps_high)
    for quantile in (0.0, 1.0, 1.5):
        with _refused(f"quantile must be in (0, 1), got {quantile}"):
            SATConfig(quantile=quantile)
    with _refused("kernel must be cauchy or rational, got 'gauss'"):
        SATConfig(kernel="gauss")  # type: ignore[arg-type]
    zeros, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with _refused("logprobs, old_logprobs and mask must share a [B, T] shape, got (2, 3), (2, 2), (2, 3)"):
        grpo_loss(zeros, torch.zeros(2, 2), torch.zeros(2), mask)
    with _refused("mask must be a bool tensor"):
        gspo_loss(zeros, zeros, torch.zeros(2), mask.float())
    with _refused("advantages must be [B] = [2], got (3,)"):
        grpo_loss(zeros, zeros, torch.zeros(3), mask)
    for denominator in (0.0, -1.0, math.inf, NAN):
        with _refused(f"denominator must be a positive count, got {denominator}"):
            grpo_loss(zeros, zeros, torch.zeros(2), mask, denominator=denominator)
    _close(grpo_loss(zeros, zeros, torch.ones(2), mask, aggregation="token", denominator=1.0).loss, -6.0)
    with _refused("temperature must be positive and finite, got inf"):
        token_logprobs(torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.long), temperature=math.inf)


@pytest.mark.parametrize("loss", ["gspo", "decoupled", "gmc", "kl"])
@pytest.mark.parametrize("argument", ["logprobs", "anchor", "advantages"])
def test_every_input_is_checked_on_trainable_tokens(loss: str, argument: str) -> None:
    mask = torch.tensor([[True, True], [True, False]])
    tensors = {"logprobs": torch.zeros(2, 2), "anchor": torch.zeros(2, 2), "advantages": torch.zeros(2)}
    tensors[argument][(0, 1) if argument != "advantages" else 1] = NAN
    logprobs, anchor, advantages = tensors["logprobs"], tensors["anchor"], tensors["advantages"]
    names = {
        "gspo": "old_logprobs",
        "decoupled": "proximal_logprobs",
        "gmc": "behaviour_logprobs",
        "kl": "reference_logprobs",
    }
    name = {"logprobs": "logprobs", "anchor": names[loss], "advantages": "advantages"}[argument]
    if loss == "kl" and argument == "advantages":
        return  # kl_k3 takes no advantages
    with _refused(
        f"{name} contain NaN or inf" + ("" if argument == "advantages" else " on trainable tokens")
    ):
        if loss == "gspo":
            gspo_loss(logprobs, anchor, advantages, mask)
        elif loss == "decoupled":
            decoupled_ppo_loss(logprobs, anchor, torch.zeros(2, 2), advantages, mask)
        elif loss == "gmc":
            gmc_loss(logprobs, anchor, advantages, mask, torch.tensor([0, 0]))
        else:
            kl_k3(logprobs, anchor, mask)
    if loss == "decoupled" and argument == "anchor":  # the behaviour log-probs are checked as well
        with _refused("behaviour_logprobs contain NaN or inf on trainable tokens"):
            decoupled_ppo_loss(torch.zeros(2, 2), torch.zeros(2, 2), anchor, torch.zeros(2), mask)


def test_entropy_token_logprobs_and_gmc_refusals_name_the_shapes() -> None:
    mask = torch.ones(1, 2, dtype=torch.bool)
    with _refused("logits must be [B, T, V] and mask [B, T], got (1, 2), (1, 2)"):
        entropy_from_logits(torch.zeros(1, 2), mask)
    with _refused("mask must be a bool tensor"):
        entropy_from_logits(torch.zeros(1, 2, 3), mask.float())
    for bad in (NAN, math.inf):
        with _refused("logits contain NaN or +inf on trainable tokens"):
            entropy_from_logits(torch.tensor([[[0.0, bad], [0.0, 0.0]]]), mask)
    # no trainable token: entropy 0, not the mean of nothing
    assert entropy_from_logits(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.bool)).item() == 0.0
    with _refused("logits must be [B, T, V] and targets [B, T], got (2, 3), (2, 3)"):
        token_logprobs(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long))
    with _refused("targets must be an integer tensor, got torch.bool"):
        token_logprobs(torch.zeros(1, 2, 5), torch.zeros(1, 2, dtype=torch.bool))
    # V = 5 > T = 2: ids 3 and 4 are valid; 5 is not, and the message names V
    _close(token_logprobs(torch.zeros(1, 2, 5), torch.tensor([[3, 4]])), [[-math.log(5)] * 2])
    with pytest.raises(ValueError, match=r"^targets must be token ids in \[0, 5\), got "):
        token_logprobs(torch.zeros(1, 2, 5), torch.tensor([[0, 5]]))
    three = torch.ones(2, 3, dtype=torch.bool)
    with _refused("group_index must be [B] = [2], got (3,)"):
        gmc_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), three, torch.tensor([0, 0, 1]))
    with _refused("group_index must be an integer tensor, got torch.bool"):
        gmc_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), three, torch.tensor([True, False]))


def test_gspo_clips_asymmetrically_and_takes_sat_quantile_over_sequences_with_tokens() -> None:
    # ClipConfig(0.1, 0.3), no SAT: s = 1.25 (A = +1) stays below 1.3: -1.25; s = 0.85 (A = -1) is
    # clipped at 0.9: -min(-0.85, -0.9) = 0.9.
    mask = torch.ones(2, 1, dtype=torch.bool)
    logprobs = torch.log(torch.tensor([[1.25], [0.85]]))
    out = gspo_loss(logprobs, torch.zeros(2, 1), torch.tensor([1.0, -1.0]), mask, ClipConfig(0.1, 0.3))
    assert out.loss.item() == pytest.approx((-1.25 + 0.9) / 2) and out.clip_fraction.item() == 0.5
    # SAT's level over the sequences' mean log π_θ - log μ = 0.1, 0.2, 0.3 (s = 1 throughout): the median
    # 0.2 gates the 0.3 row with k = 0.8. The two rows without tokens are no part of it (with their zeros
    # the median would be 0.1 and gate two rows).
    d = torch.tensor([[0.1], [0.2], [0.3], [NAN], [NAN]])
    mask = torch.isfinite(d)
    logprobs = torch.where(mask, -1.0, NAN)
    gated = gspo_loss(
        logprobs, logprobs, torch.ones(5), mask, sat=SATConfig(quantile=0.5), behaviour_logprobs=logprobs - d
    )
    assert gated.gate_rate.item() == pytest.approx(1 / 3)
    assert gated.mean_contraction.item() == pytest.approx(0.8, rel=1e-5)
    assert gated.loss.item() == pytest.approx(-1.0)
