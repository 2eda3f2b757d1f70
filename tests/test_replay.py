"""R3 routing replay in the training forward: identical log-probs at unchanged weights (both MoE families),
a lower training–inference mismatch under a perturbed rollout router, gradients to the router, per-
segment routes across versions, validated shapes, and a model always restored."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from agents.engine import EmbeddedEngine, EmbeddedEngineConfig, SamplingParams
from agents.models import TinyMoEConfig, build_tiny_moe, moe_info
from agents.routing import RoutedExperts
from agents.tokenizer import tiny_tokenizer
from agents.trajectory import Status, Trajectory
from trainer.learner import Learner, LearnerConfig
from trainer.replay import routing_replay

SAMPLING = SamplingParams(max_new_tokens=24, temperature=1.0, seed=3)
PROMPTS = [[5, 17, 40, 41, 9], [7, 8, 100, 101, 102, 103, 12], [30, 31, 32]]


def model_of(family: str = "qwen3_moe", seed: int = 0) -> torch.nn.Module:
    return build_tiny_moe(TinyMoEConfig(family=family, num_layers=2, seed=seed), tiny_tokenizer())  # type: ignore[arg-type]


async def rollouts(engine_model: torch.nn.Module, prompts: list[list[int]] = PROMPTS) -> list[Trajectory]:
    """One recorded generation per prompt, as the rollout driver stores it (routes included)."""
    engine = EmbeddedEngine(engine_model, config=EmbeddedEngineConfig(seed=1))
    info = moe_info(engine_model)
    trajectories = []
    for index, prompt in enumerate(prompts):
        started = time.time()
        out = await engine.generate(prompt, SAMPLING, return_routed_experts=True)
        assert out.routed_experts is not None
        trajectory = Trajectory.start(f"t{index}", "g", "task", prompt)
        rows = out.routed_experts[len(out.routed_experts) - len(out.tokens) :]
        trajectory.append_model(
            out.tokens,
            out.logprobs,
            version=0,
            started_at=started,
            ended_at=time.time(),
            finish_reason=out.finish_reason.value,
            routed_experts=RoutedExperts.from_array(rows, num_experts=info.num_experts),
        )
        trajectory.finish(
            Status.COMPLETED, reason="", reward=1.0, completed_version=0, completed_at=time.time()
        )
        trajectories.append(trajectory)
    await engine.aclose()
    return trajectories


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
async def test_replay_at_unchanged_weights_reproduces_the_engine_logprobs(family: str) -> None:
    model = model_of(family)
    trajectories = await rollouts(copy.deepcopy(model))
    learner = Learner(model, LearnerConfig(temperature=1.0))
    batch, replayed, disagreement = learner.logprobs(trajectories, replay_routes=True)
    mask = batch.loss_mask
    torch.testing.assert_close(replayed[mask], batch.behaviour[mask], atol=2e-5, rtol=0)
    assert disagreement == 0.0  # same weights: the live router agrees with the engine everywhere
    assert batch.replay is not None and int(batch.replay.sum()) == int(mask.sum())


async def test_replay_lowers_the_mismatch_of_a_perturbed_rollout_router() -> None:
    trainer_model = model_of()
    engine_model = copy.deepcopy(trainer_model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the engine's routers differ, like kernels or precision that flip top-k choices
        for gate in moe_info(engine_model).gates:
            gate.weight.add_(torch.randn(gate.weight.shape, generator=generator) * 0.5 * gate.weight.std())
    trajectories = await rollouts(engine_model, PROMPTS * 2)
    learner = Learner(trainer_model, LearnerConfig(temperature=1.0))
    mismatch = learner.mismatch(trajectories)
    assert mismatch["routing_disagreement"] > 0.02
    assert mismatch["mismatch_r3"] < 0.8 * mismatch["mismatch_live"]


async def test_gradients_reach_the_router_through_replayed_routes() -> None:
    model = model_of()
    trajectories = await rollouts(copy.deepcopy(model))
    learner = Learner(model, LearnerConfig(temperature=1.0))
    batch = learner.collate(trajectories)
    assert batch.routes is not None and batch.replay is not None
    with routing_replay(model, batch.routes, batch.replay):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logits[:, :-1].log_softmax(-1).gather(-1, batch.targets[..., None]).sum().backward()
    for gate in moe_info(model).gates:
        assert gate.weight.grad is not None and gate.weight.grad.abs().sum() > 0


async def test_each_segment_replays_the_routes_it_was_generated_with() -> None:
    """A trajectory spanning two versions: the routes tensor holds each token's own recorded row, at the
    input position that produced it."""
    model = model_of()
    engine = EmbeddedEngine(copy.deepcopy(model), config=EmbeddedEngineConfig(seed=1))
    prompt = PROMPTS[0]
    first = await engine.generate(prompt, SAMPLING, return_routed_experts=True)
    second = await engine.generate(prompt + list(first.tokens), SAMPLING, return_routed_experts=True)
    await engine.aclose()
    assert first.routed_experts is not None and second.routed_experts is not None
    trajectory = Trajectory.start("t", "g", "task", prompt)
    for version, out in enumerate((first, second)):
        assert out.routed_experts is not None
        trajectory.append_model(
            out.tokens,
            out.logprobs,
            version=version,
            started_at=0.0,
            ended_at=0.0,
            finish_reason="stop",
            routed_experts=RoutedExperts.from_array(out.routed_experts[-len(out.tokens) :], num_experts=8),
        )
    trajectory.finish(Status.COMPLETED, reason="", reward=0.0, completed_version=1, completed_at=0.0)
    batch = Learner(model).collate([trajectory])
    assert batch.routes is not None and batch.replay is not None
    start = len(prompt)
    for out in (first, second):
        assert out.routed_experts is not None
        rows = torch.from_numpy(out.routed_experts[-len(out.tokens) :].astype("int64"))
        # The row of token p sits at input position p - 1.
        assert torch.equal(batch.routes[0, start - 1 : start - 1 + len(out.tokens)], rows)
        start += len(out.tokens)
    assert int(batch.replay.sum()) == len(first.tokens) + len(second.tokens)
    assert not batch.replay[0, : len(prompt) - 1].any()  # prompt inputs keep the live router


def test_replay_validates_its_data_and_always_restores_the_model() -> None:
    model = model_of()
    gates = moe_info(model).gates
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    replay = torch.ones(1, 4, dtype=torch.bool)
    good = torch.tensor([[0, 1], [2, 3]]).expand(1, 4, 2, 2).clone()
    with pytest.raises(ValueError, match="layers, top_k"), routing_replay(model, good[:, :, :1], replay):
        pass
    with pytest.raises(ValueError, match=r"\[0, 8\)"), routing_replay(model, good + 7, replay):
        pass
    twice = torch.zeros_like(good)
    with pytest.raises(ValueError, match="same expert twice"), routing_replay(model, twice, replay):
        pass
    with pytest.raises(ValueError, match="integer"), routing_replay(model, good.float(), replay):
        pass
    with pytest.raises(ValueError, match="saw 8"), routing_replay(model, good, replay):
        model(input_ids=torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]]))
    with pytest.raises(RuntimeError, match="boom"), routing_replay(model, good, replay):
        raise RuntimeError("boom")
    assert all(not gate._forward_hooks for gate in gates)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)
    with torch.no_grad(), routing_replay(model, good, replay):
        forced = model(input_ids=ids).logits
    assert not torch.allclose(forced, before)  # the replay really decided the routing
