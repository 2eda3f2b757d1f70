"""The learner's step: every loss trains, and bad input (empty responses, all-equal rewards, non-finite
log-probs, routes of the wrong shape) becomes a clear error or a counted skip, never NaN weights."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from pacerl.agents.trajectory import Status, Trajectory
from pacerl.trainer.learner import Learner, LearnerConfig
from pacerl.trainer.policy_losses import BUILT_IN_LOSSES, GSPOSettings, LossConfig
from tests.trainer.helpers import make_trajectory, on_policy, small_model, two_groups


def parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def unchanged(model: torch.nn.Module, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("loss", BUILT_IN_LOSSES)
def test_every_loss_takes_a_finite_step_that_favours_the_rewarded_response(loss: str) -> None:
    model = small_model()
    learner = Learner(model, LearnerConfig(loss=LossConfig(name=loss), lr=1e-2))  # type: ignore[arg-type]
    groups = on_policy(learner, two_groups())
    batch, before, _ = learner.logprobs([t for g in groups for t in g])
    result = learner.train_step(groups)
    assert result.updated and learner.version == 1
    assert all(np.isfinite(v) for v in result.metrics.values())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    _, after, _ = learner.logprobs([t for g in groups for t in g])
    gain = ((after - before) * batch.loss_mask).sum(-1)
    assert gain[0] > gain[1] and gain[3] > gain[2]  # the rewarded member of each group gained more
    assert result.trajectory_ids == ("a/0", "a/1", "b/0", "b/1")


def test_all_equal_rewards_and_empty_responses_skip_without_touching_the_weights() -> None:
    model = small_model()
    # Anchored at its own log-probs: the made-up behaviour log-probs would put every ratio outside the clip.
    learner = Learner(model, LearnerConfig(loss=LossConfig(gspo=GSPOSettings(ratio_anchor="recompute"))))
    before = parameters(model)
    equal = [[make_trajectory("a/0", "a", 1.0, [20]), make_trajectory("a/1", "a", 1.0, [21])]]
    result = learner.train_step(equal)
    assert (result.updated, result.skipped) == (False, "no_signal")
    assert learner.counts["zero_advantage"] == 1 and learner.version == 0
    empty = Trajectory.start("b/0", "b", "task", [5, 6])
    empty.append_tool([7, 8])
    empty.finish(Status.COMPLETED, reason="", reward=1.0, completed_version=0, completed_at=0.0)
    failed = Trajectory.start("b/2", "b", "task", [5, 6])
    failed.finish(Status.FAILED, reason="engine failed", reward=None, completed_version=0, completed_at=0.0)
    mixed = [[empty, make_trajectory("b/1", "b", 0.0, [20, 21]), failed]]
    result = learner.train_step(mixed)
    assert result.updated  # the empty member's reward still sets its group's baseline
    assert learner.counts["empty_response"] == 1 and learner.counts["failed_member"] == 1
    assert result.metrics["trained_trajectories"] == 1
    assert not unchanged(model, before)


def test_nonfinite_logprobs_are_refused_or_skipped() -> None:
    with pytest.raises(ValueError, match="finite"):
        make_trajectory("a/0", "a", 1.0, [20], logprob=float("nan"))
    model = small_model()
    learner = Learner(model)
    before = parameters(model)
    poison = model.lm_head.register_forward_hook(lambda module, inputs, output: output * float("nan"))
    try:
        result = learner.train_step(two_groups())
    finally:
        poison.remove()
    assert (result.updated, result.skipped) == (False, "nonfinite_logprobs")
    assert unchanged(model, before) and learner.version == 0
    assert all(p.grad is None for p in model.parameters())


def test_nonfinite_gradients_skip_the_update() -> None:
    model = small_model()
    learner = Learner(model)
    before = parameters(model)
    embeddings = model.get_input_embeddings()
    poison = embeddings.weight.register_hook(lambda grad: grad * float("inf"))
    try:
        result = learner.train_step(two_groups())
    finally:
        poison.remove()
    assert (result.updated, result.skipped) == (False, "nonfinite_grad")
    assert unchanged(model, before)


def test_routes_of_the_wrong_shape_are_a_clear_error() -> None:
    learner = Learner(small_model())
    wrong_layers = np.tile(np.array([[0, 1]] * 3, dtype=np.int64), (2, 1, 1))  # 3 layers, model has 2
    groups = [
        [
            make_trajectory("a/0", "a", 1.0, [20, 21], routes=wrong_layers),
            make_trajectory("a/1", "a", 0.0, [22, 23], routes=wrong_layers),
        ]
    ]
    with pytest.raises(ValueError, match="2 MoE layers with top_k=2"):
        learner.train_step(groups)
    with pytest.raises(ValueError, match="must be RoutedExperts with 2 rows"):
        make_trajectory("a/0", "a", 1.0, [20, 21], routes=wrong_layers[:1])


def test_micro_batches_accumulate_to_the_full_batch_gradient() -> None:
    model = small_model()
    whole = Learner(copy.deepcopy(model), LearnerConfig(loss=LossConfig(name="grpo", sat=False), lr=1e-2))
    split = Learner(
        copy.deepcopy(model),
        LearnerConfig(loss=LossConfig(name="grpo", sat=False), lr=1e-2, micro_batch_size=2),
    )
    groups = on_policy(whole, two_groups())
    for learner in (whole, split):
        learner.optimizer.step = lambda *args, **kwargs: None  # type: ignore[method-assign]  # keep the grads
        learner.train_step(groups)
    for p, q in zip(whole.model.parameters(), split.model.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, atol=1e-7, rtol=1e-4)


def test_kl_and_entropy_terms_and_state_round_trip() -> None:
    model = small_model()
    learner = Learner(model, LearnerConfig(loss=LossConfig(kl_coef=0.1, entropy_coef=0.01), lr=1e-2))
    assert learner.reference is not None
    groups = on_policy(learner, two_groups())
    first = learner.train_step(groups)
    assert first.metrics["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy starts at the reference
    second = learner.train_step(groups)
    assert second.metrics["kl"] > 0 and second.metrics["entropy"] > 0
    state = learner.state_dict()
    restored = Learner(small_model(), learner.config)
    restored.load_state_dict(state)
    assert restored.version == 2
    for p, q in zip(restored.model.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
