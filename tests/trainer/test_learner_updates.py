"""The learner's arithmetic across micro-batches and updates: the accumulated gradient does not depend on
`micro_batch_size` for any loss (SAT, KL and entropy included), and with several updates per batch the
proximal policy is the one before the first update, so the clip and SAT act on the later ones."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

from pacerl.agents.trajectory import Trajectory
from pacerl.config import ConfigError, load_config
from pacerl.trainer.batch import TokenBatch, collate, forward_logprobs
from pacerl.trainer.learner import Learner, LearnerConfig
from pacerl.trainer.losses import (
    ClipConfig,
    SATConfig,
    decoupled_ppo_loss,
    gspo_loss,
    sat_threshold,
    sequence_staleness,
)
from pacerl.trainer.policy_losses import (
    BUILT_IN_LOSSES,
    LOSSES,
    DecoupledPPOSettings,
    GRPOSettings,
    GSPOSettings,
    LossConfig,
)
from tests.trainer.helpers import on_policy, ragged_groups_of_small_model, small_model, two_groups


def step_gradients(
    learner: Learner, groups: list[list[Trajectory]]
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """The gradient of each update of one `train_step` (the weights still move between updates)."""
    recorded: list[torch.Tensor] = []
    step = learner.optimizer.step

    def recording_step(*args: object, **kwargs: object) -> None:
        recorded.append(
            torch.cat([p.grad.flatten() for p in learner.model.parameters() if p.grad is not None])
        )
        step()

    learner.optimizer.step = recording_step  # type: ignore[method-assign]
    result = learner.train_step(groups)
    assert result.updated, result.skipped
    return recorded, result.metrics


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


CASES = [
    (loss, sat, aggregation)
    for loss in BUILT_IN_LOSSES
    for sat in (True, False)
    for aggregation in ("token", "sequence")
    if not (loss == "gmc" and sat) and (aggregation == "token" or loss in ("grpo", "decoupled_ppo"))
]


# With the KL and entropy terms the matrix doubles: `make test` runs it, the inner loop the plain half.
@pytest.mark.parametrize(
    "regularised", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["plain", "kl+entropy"]
)
@pytest.mark.parametrize(
    ("loss", "sat", "aggregation"),
    CASES,
    ids=[f"{loss}-{'sat' if sat else 'nosat'}-{aggregation}" for loss, sat, aggregation in CASES],
)
def test_the_gradient_does_not_depend_on_the_micro_batch_size(
    loss: str, sat: bool, aggregation: str, regularised: bool
) -> None:
    model = small_model()
    groups = ragged_groups_of_small_model(far=1.5)
    coefficients = {"kl_coef": 0.05, "entropy_coef": 0.01} if regularised else {}
    reference_model = copy.deepcopy(model)
    with torch.no_grad():  # a reference away from the policy, so the KL term has a gradient
        for parameter in reference_model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    gradients, metrics = {}, {}
    for size in (64, 1, 5):
        own: dict[str, object] = {
            "grpo": {"grpo": GRPOSettings(aggregation=aggregation)},  # type: ignore[arg-type]
            "decoupled_ppo": {"decoupled_ppo": DecoupledPPOSettings(aggregation=aggregation)},  # type: ignore[arg-type]
        }.get(loss, {})
        config = LossConfig(name=loss, sat=sat, **own, **coefficients)  # type: ignore[arg-type]
        learner = Learner(copy.deepcopy(model), LearnerConfig(loss=config, micro_batch_size=size))
        if learner.reference is not None:
            learner.reference.load_state_dict(reference_model.state_dict())
        (gradients[size],), metrics[size] = step_gradients(learner, groups)
    for size in (1, 5):
        assert relative(gradients[size], gradients[64]) <= 1e-4, size
        for name in ("loss", "sat_gate_rate", "clip_fraction", "entropy", "kl"):
            assert metrics[size][name] == pytest.approx(metrics[64][name], rel=1e-4, abs=1e-7), (size, name)
    if sat:  # the gate acted on the batch's quantile: about 1 - 0.9 of the entries are gated
        assert 0.05 <= metrics[64]["sat_gate_rate"] <= 0.15


def test_the_sat_quantile_is_the_batchs_not_each_micro_batchs() -> None:
    """One group whose staleness is far above the others': gated as a whole batch's outlier, while a
    per-micro-batch quantile would gate a tenth of every micro-batch."""
    model = small_model()
    groups = ragged_groups_of_small_model()
    stale = ragged_groups_of_small_model(seed=1, far=3.0)[0]
    batch = [*groups, stale]
    config = LossConfig(name="gspo", sat=True)
    gated = {}
    for size in (100, 4):
        learner = Learner(copy.deepcopy(model), LearnerConfig(loss=config, micro_batch_size=size))
        _, metrics = step_gradients(learner, batch)
        gated[size] = metrics["sat_gate_rate"]
    assert gated[4] == pytest.approx(gated[100], abs=1e-6)
    assert gated[100] == pytest.approx(3 / 28, abs=1e-6)  # per micro-batch it would be 7 / 28


@pytest.mark.parametrize(
    "config",
    [
        LossConfig(name="decoupled_ppo", sat=False),
        LossConfig(name="grpo", sat=False, grpo=GRPOSettings(ratio_anchor="recompute")),
        LossConfig(name="gspo", sat=False, gspo=GSPOSettings(ratio_anchor="recompute")),
    ],
    ids=["decoupled_ppo", "grpo-recompute", "gspo-recompute"],
)
def test_the_clip_acts_on_the_second_and_later_updates(config: LossConfig) -> None:
    model = small_model()
    groups = ragged_groups_of_small_model()
    updates, metrics = {}, {}
    for eps in (0.2, 0.01):
        loss = LossConfig(**{**config.__dict__, "eps_low": eps, "eps_high": eps})
        learner = Learner(copy.deepcopy(model), LearnerConfig(loss=loss, minibatches=3, epochs=2, lr=1e-2))
        updates[eps], metrics[eps] = step_gradients(learner, groups)
        assert learner.version == 1 and metrics[eps]["updates"] == 6
    # The first update is at the proximal weights (ratio 1): the clip cannot act there; later it does.
    assert torch.equal(updates[0.2][0], updates[0.01][0])
    for later in range(1, 6):
        assert relative(updates[0.01][later], updates[0.2][later]) > 1e-3, later
    assert metrics[0.01]["clip_fraction"] > metrics[0.2]["clip_fraction"] >= 0
    assert metrics[0.01]["clip_fraction"] > 0.05


def test_sat_acts_on_the_later_updates_of_decoupled_ppo() -> None:
    model = small_model()
    groups = ragged_groups_of_small_model(far=2.0)
    updates, metrics = {}, {}
    for sat in (False, True):
        config = LearnerConfig(
            loss=LossConfig(name="decoupled_ppo", sat=sat), minibatches=2, epochs=2, lr=1e-2
        )
        learner = Learner(copy.deepcopy(model), config)
        updates[sat], metrics[sat] = step_gradients(learner, groups)
    assert torch.equal(updates[True][0], updates[False][0])  # ratio 1 at the proximal weights
    assert all(relative(updates[True][i], updates[False][i]) > 1e-4 for i in range(1, 4))
    assert metrics[False]["sat_active_rate"] == 0 and metrics[False]["sat_gate_rate"] == 0
    assert metrics[True]["sat_active_rate"] > 0 and metrics[True]["sat_gate_rate"] > 0


def test_one_update_spends_no_proximal_pass_and_versions_count_batches() -> None:
    model = small_model()
    groups = ragged_groups_of_small_model()
    learner = Learner(copy.deepcopy(model), LearnerConfig(loss=LossConfig(name="decoupled_ppo")))
    forwards = 0

    def count(*_: object) -> None:
        nonlocal forwards
        forwards += 1

    handle = learner.model.register_forward_hook(count)
    try:
        result = learner.train_step(groups)
    finally:
        handle.remove()
    assert result.metrics["updates"] == 1 and learner.version == 1
    assert forwards == 1  # 24 sequences, one micro-batch, no proximal or quantile pass
    # With the decoupled ratio identically 1 in a single update, nothing can be clipped.
    assert result.metrics["clip_fraction"] == 0
    several = Learner(copy.deepcopy(model), LearnerConfig(minibatches=4, epochs=3))
    result = several.train_step(groups)
    assert result.metrics["updates"] == 12 and several.version == 1


def test_the_shuffle_is_seeded_and_splits_whole_groups() -> None:
    model = small_model()
    groups = ragged_groups_of_small_model()
    config = LearnerConfig(minibatches=4, epochs=2, shuffle_seed=3)
    first, second = Learner(copy.deepcopy(model), config), Learner(copy.deepcopy(model), config)
    plan = first._update_plan(first._prepare(groups))
    assert plan == second._update_plan(second._prepare(groups))
    prepared = first._prepare(groups)
    for epoch in (0, 1):
        parts = [members for e, members in plan if e == epoch]
        assert len(parts) == 4
        assert sorted(i for members in parts for i in members) == list(range(len(prepared.trajectories)))
        for members in parts:  # whole groups
            kept = {prepared.group_index[i] for i in members}
            assert sum(prepared.group_index.count(g) for g in kept) == len(members)
    orders = [
        [prepared.group_index[i] for members in [m for e, m in plan if e == epoch] for i in members]
        for epoch in (0, 1)
    ]
    assert orders[0] != orders[1]  # each epoch reshuffles
    few = Learner(copy.deepcopy(model), LearnerConfig(minibatches=50))
    assert len(few._update_plan(few._prepare(groups))) == 6  # no more updates than groups


def test_a_skipped_update_leaves_the_others() -> None:
    model = small_model()
    groups = ragged_groups_of_small_model()
    learner = Learner(copy.deepcopy(model), LearnerConfig(minibatches=2))
    calls = 0
    original = torch.nn.utils.clip_grad_norm_

    def poisoned(parameters: object, max_norm: float) -> torch.Tensor:
        nonlocal calls
        calls += 1
        norm = original(parameters, max_norm)  # type: ignore[arg-type]
        return norm * float("nan") if calls == 1 else norm

    torch.nn.utils.clip_grad_norm_ = poisoned  # type: ignore[assignment]
    try:
        result = learner.train_step(groups)
    finally:
        torch.nn.utils.clip_grad_norm_ = original
    assert result.updated and learner.version == 1
    assert result.metrics["updates"] == 1 and result.metrics["skipped_updates"] == 1
    assert learner.counts["nonfinite_grad"] == 1


def test_training_refuses_truncated_sampling_and_takes_the_update_plan_from_the_config() -> None:
    for override in ("rollout.sampling.top_p=0.5", "rollout.sampling.top_k=20"):
        with pytest.raises(ConfigError, match="learner scores the full softmax"):
            load_config(None, [override])
    overrides = ["learner.minibatches=4", "learner.epochs=2", "learner.advantage_std=unbiased"]
    config = load_config(None, overrides)
    assert (config.learner.minibatches, config.learner.epochs) == (4, 2)
    assert config.learner.advantage_std == "unbiased"
    with pytest.raises(ConfigError, match="minibatches"):
        load_config(None, ["learner.minibatches=0"])


def test_a_max_age_below_the_publication_lag_is_a_config_error() -> None:
    with pytest.raises(
        ConfigError, match=r"filter\.max_age\.versions \(0\) must be >= loop\.sync_interval - 1 \(2\)"
    ):
        load_config(None, ["filter.name=max_age", "filter.max_age.versions=0", "loop.sync_interval=3"])
    assert load_config(None, ["filter.name=max_age", "filter.max_age.versions=2", "loop.sync_interval=3"])


def test_every_built_in_loss_is_registered_with_its_traits() -> None:
    assert BUILT_IN_LOSSES == ("gspo", "gspo_token", "grpo", "decoupled_ppo", "gmc")
    assert all(LOSSES[name].section == ("gspo" if name == "gspo_token" else name) for name in BUILT_IN_LOSSES)
    # what each averages over and counts, whether it needs the proximal pass, how SAT measures it
    traits = {
        name: (LossConfig(name=name).mean_unit, loss.entries, LossConfig(name=name).uses_proximal, loss.sat)
        for name, loss in LOSSES.items()
        if name in BUILT_IN_LOSSES
    }
    assert traits == {
        "gspo": ("sequence", "sequence", False, "sequence"),
        "gspo_token": ("sequence", "sequence", False, "sequence"),
        "grpo": ("token", "token", False, "token"),
        "decoupled_ppo": ("token", "token", True, "token"),
        "gmc": ("sequence", "group", False, None),
    }
    with pytest.raises(ValueError, match="loss name must be one of gspo, gspo_token"):
        LossConfig(name="ppo")


def test_each_loss_reads_its_own_section() -> None:
    assert LossConfig(name="grpo", grpo=GRPOSettings(aggregation="sequence")).mean_unit == "sequence"
    assert LossConfig(
        name="decoupled_ppo", decoupled_ppo=DecoupledPPOSettings(aggregation="sequence")
    ).mean_unit == ("sequence")
    assert LossConfig(name="gspo_token", gspo=GSPOSettings(ratio_anchor="recompute")).uses_proximal
    assert LossConfig(name="grpo", grpo=GRPOSettings(ratio_anchor="recompute")).uses_proximal
    assert LossConfig(name="gmc").settings == LossConfig().gmc
    # another loss's section is inert (a sweep over names keeps every section)
    assert LossConfig(name="decoupled_ppo", grpo=GRPOSettings(aggregation="sequence")).mean_unit == "token"
    assert not LossConfig(name="gspo", grpo=GRPOSettings(ratio_anchor="recompute")).uses_proximal
    with pytest.raises(ValueError, match=r"decoupled_ppo\.weight_cap must be > 1"):
        DecoupledPPOSettings(weight_cap=1.0)
    with pytest.raises(
        ConfigError, match=r"learner.loss.weight_cap moved to learner.loss.decoupled_ppo.weight_cap"
    ):
        load_config(None, ["learner.loss.weight_cap=3"])
    with pytest.raises(ConfigError, match=r"learner.loss.gmc_eps moved to learner.loss.gmc.eps"):
        load_config(None, ["learner.loss.gmc_eps=0.3"])
    config = load_config(None, ["learner.loss.name=decoupled_ppo", "learner.loss.decoupled_ppo.weight_cap=3"])
    assert config.learner.loss.decoupled_ppo.weight_cap == 3.0


def gradient_of(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter's gradient in one vector (0 where a parameter got none)."""
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()]
    )


MEANS = [
    ("gspo", "sequence"),
    ("gspo_token", "sequence"),
    ("gmc", "sequence"),
    ("grpo", "sequence"),
    ("decoupled_ppo", "sequence"),
    ("grpo", "token"),
    ("decoupled_ppo", "token"),
]


@pytest.mark.parametrize(("loss", "aggregation"), MEANS, ids=[f"{loss}-{unit}" for loss, unit in MEANS])
def test_the_accumulated_gradient_divides_by_the_batchs_sequences_or_tokens_by_hand(
    loss: str, aggregation: str
) -> None:
    """`two_groups` on policy: responses of 3, 2 | 4, 1 tokens, rewards 1, 0 | 0, 1, so advantages
    +1, -1 | -1, +1 (the population std of each group is 0.5), every ratio 1 and nothing clipped, gated
    or capped. Every loss's gradient is then the policy gradient -(1/4) Σ_i A_i ∇(mean log π over y_i)
    for a sequence mean (4 sequences) and -(1/10) Σ_i A_i ∇(Σ log π over y_i) for a token mean (10
    tokens): accumulated over micro-batches of one group each, the learner's gradient must be it. A
    sequence mean divided by the 10 tokens would give 0.4 times it; a token mean by the 4 sequences,
    2.5 times."""
    model = small_model()
    sections: dict[str, dict[str, Any]] = {
        "grpo": {"grpo": GRPOSettings(aggregation=aggregation)},  # type: ignore[arg-type]
        "decoupled_ppo": {"decoupled_ppo": DecoupledPPOSettings(aggregation=aggregation)},  # type: ignore[arg-type]
    }
    config = LossConfig(name=loss, **sections.get(loss, {}))  # type: ignore[arg-type]
    learner = Learner(copy.deepcopy(model), LearnerConfig(loss=config, micro_batch_size=2, grad_clip=1e9))
    groups = on_policy(learner, two_groups())
    learner.optimizer.step = lambda *args, **kwargs: None  # type: ignore[method-assign]  # keep the grads
    result = learner.train_step(groups)
    assert result.updated and result.metrics["clip_fraction"] == 0
    batch = collate([t for group in groups for t in group], learner.pad_id)
    lengths = torch.tensor([3, 2, 4, 1])
    assert torch.equal(batch.loss_mask.sum(-1), lengths)
    advantages = torch.tensor([1.0, -1.0, -1.0, 1.0])
    logprobs, _, _ = forward_logprobs(model, batch, temperature=1.0, replay_routes=False)
    summed = (logprobs * batch.loss_mask).sum(-1)
    objective = (
        (advantages * summed / lengths).sum() / 4
        if aggregation == "sequence"
        else (advantages * summed).sum() / 10
    )
    torch.autograd.backward(-objective)
    assert relative(gradient_of(learner.model), gradient_of(model)) <= 1e-4


LATER_UPDATES = {
    "decoupled_ppo": LossConfig(name="decoupled_ppo"),
    "gspo-recompute": LossConfig(name="gspo", gspo=GSPOSettings(ratio_anchor="recompute")),
}
"""The losses whose later updates clip against the weights before the step's first update."""


def one_piece_gradient(
    loss: str,
    model: torch.nn.Module,
    batch: TokenBatch,
    proximal: torch.Tensor,
    advantages: torch.Tensor,
    threshold: torch.Tensor | None,
) -> torch.Tensor:
    """The gradient at `model`'s weights of the whole mini-batch's loss from the pure function, SAT on
    with the default clip and quantile; `threshold` None: the loss takes its own quantile, over these
    log-probs."""
    model.zero_grad(set_to_none=True)
    logprobs, _, _ = forward_logprobs(model, batch, temperature=1.0, replay_routes=False)
    clip, sat, mask = ClipConfig(0.2, 0.2), SATConfig(0.9, "cauchy"), batch.loss_mask
    if loss == "decoupled_ppo":
        output = decoupled_ppo_loss(
            logprobs, proximal, batch.behaviour, advantages, mask, clip, sat=sat, sat_threshold=threshold
        )
    else:
        output = gspo_loss(
            logprobs, proximal, advantages, mask, clip, False, sat, batch.behaviour, sat_threshold=threshold
        )
    torch.autograd.backward(output.loss)
    return gradient_of(model)


def proximal_threshold(loss: str, proximal: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    """SAT's quantile at the weights before the step's first update: over tokens (decoupled_ppo) or
    over each sequence's mean (gspo)."""
    mask, sat = batch.loss_mask, SATConfig(0.9, "cauchy")
    if loss == "decoupled_ppo":
        return sat_threshold((proximal - batch.behaviour)[mask], torch.tensor(True), sat)
    return sat_threshold(sequence_staleness(proximal, batch.behaviour, mask), mask.any(-1), sat)


@pytest.mark.parametrize("loss", list(LATER_UPDATES))
def test_each_later_update_takes_sats_quantile_at_its_own_weights(loss: str) -> None:
    """2 mini-batches × 2 epochs of 3 groups of 4 (12 sequences each), micro-batches of 4 sequences, so
    the learner takes SAT's quantile in a pass of its own. §8b: batch statistics are the batch's, so the
    quantile of an update is taken at the weights of that update, not at the proximal weights of the
    step's first one. Hence (1) each update gates the entries above the 0.9 quantile of its own entries
    (n of them: n - 1 - floor(0.9 (n - 1)), 2 of 12 sequences for gspo) and (2) its gradient is that of
    its whole mini-batch's loss in one piece at its weights, from the pure loss function, which takes
    its own quantile. The quantile at the proximal weights moves the gradient of at least one later
    update by more than 5%, so (2) tells the two apart."""
    model = small_model()
    groups = ragged_groups_of_small_model()
    config = LearnerConfig(
        loss=LATER_UPDATES[loss], minibatches=2, epochs=2, lr=1e-3, micro_batch_size=4, grad_clip=1e9
    )
    learner = Learner(copy.deepcopy(model), config)
    plans: list[tuple[Any, list[tuple[int, list[int]]]]] = []
    plan_of = learner._update_plan

    def spied_plan(prepared: Any) -> list[tuple[int, list[int]]]:
        plans.append((prepared, plan_of(prepared)))
        return plans[-1][1]

    weights: list[dict[str, torch.Tensor]] = []
    gradients: list[torch.Tensor] = []
    step = learner.optimizer.step

    def recording_step(*args: object, **kwargs: object) -> None:
        weights.append(copy.deepcopy(learner.model.state_dict()))
        gradients.append(gradient_of(learner.model))
        step()

    learner._update_plan = spied_plan  # type: ignore[method-assign]
    learner.optimizer.step = recording_step  # type: ignore[method-assign]
    result = learner.train_step(groups)
    assert result.metrics["updates"] == 4
    ((prepared, plan),) = plans
    current = copy.deepcopy(model)
    entries, gated, moved_by_stale = 0, 0, []
    for update, (_, members) in enumerate(plan):
        assert len(members) == 12  # 3 micro-batches
        batch = collate([prepared.trajectories[i] for i in members], learner.pad_id)
        n = len(members) if loss.startswith("gspo") else batch.num_tokens
        entries, gated = entries + n, gated + n - 1 - math.floor(0.9 * (n - 1))
        advantages = torch.tensor([prepared.advantages[i] for i in members])
        with torch.no_grad():  # the weights before the step's first update (the learner trained a copy)
            proximal, _, _ = forward_logprobs(model, batch, temperature=1.0, replay_routes=False)
        current.load_state_dict(weights[update])
        pieces = (loss, current, batch, proximal, advantages)
        at_these_weights = one_piece_gradient(*pieces, None)
        assert relative(gradients[update], at_these_weights) <= 1e-4, update
        if update:
            stale = one_piece_gradient(*pieces, proximal_threshold(loss, proximal, batch))
            moved_by_stale.append(relative(stale, at_these_weights))
    assert result.metrics["sat_gate_rate"] == pytest.approx(gated / entries, abs=1e-6)
    assert max(moved_by_stale) > 0.05, moved_by_stale
