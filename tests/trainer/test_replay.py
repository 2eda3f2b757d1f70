"""R3 routing replay in the training forward: identical log-probs at unchanged weights (both MoE families),
the engine's log-probs reproduced under a perturbed rollout router once every position is replayed,
gradients to the router, per-segment routes across versions, validated shapes, and a model always
restored."""

from __future__ import annotations

import copy
import math
import time

import numpy as np
import pytest
import torch

from pacerl.agents.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from pacerl.agents.engine.protocol import SamplingParams
from pacerl.agents.models import TinyMoEConfig, build_tiny_moe, moe_info
from pacerl.agents.rollout import append_generation
from pacerl.agents.routing import RoutedExperts
from pacerl.agents.tokenizer import tiny_tokenizer
from pacerl.agents.trajectory import Origin, Status, Trajectory
from pacerl.trainer.batch import collate, forward_logprobs
from pacerl.trainer.learner import Learner, LearnerConfig
from pacerl.trainer.replay import check_routes, routing_replay
from tests.agents.helpers import tiny_dense
from tests.trainer.helpers import ragged_groups

SAMPLING = SamplingParams(max_new_tokens=24, temperature=1.0, seed=3)
PROMPTS = [[5, 17, 40, 41, 9], [7, 8, 100, 101, 102, 103, 12], [30, 31, 32]]
TOOL = [60, 61, 62, 63]
"""A tool response between the two turns of `rollouts`."""


def model_of(family: str = "qwen3_moe", seed: int = 0, top_k: int = 2) -> torch.nn.Module:
    config = TinyMoEConfig(family=family, num_layers=2, seed=seed, top_k=top_k)  # type: ignore[arg-type]
    return build_tiny_moe(config, tiny_tokenizer())


def perturb_routers(model: torch.nn.Module, noise: float = 0.5) -> None:
    """Routers that differ from the trainer's, like kernels or precision that flip top-k choices."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for gate in moe_info(model).gates:
            gate.weight.add_(torch.randn(gate.weight.shape, generator=generator) * noise * gate.weight.std())


async def rollouts(
    engine_model: torch.nn.Module, prompts: list[list[int]] = PROMPTS, *, turns: int = 2
) -> list[Trajectory]:
    """One recorded episode per prompt, as the rollout driver records it: `turns` generations with the
    tool response `TOOL` between them, each call asking for the routes the record lacks."""
    engine = EmbeddedEngine(engine_model, config=EmbeddedEngineConfig(seed=1))
    info = moe_info(engine_model)
    trajectories = []
    for index, prompt in enumerate(prompts):
        trajectory = Trajectory.start(f"t{index}", "g", "task", prompt)
        for turn in range(turns):
            if turn:
                trajectory.append_tool(TOOL)
            started = time.time()
            out = await engine.generate(
                list(trajectory.tokens),
                SAMPLING,
                return_routed_experts=True,
                routed_experts_start_len=trajectory.routed_length,
            )
            append_generation(
                trajectory, out, num_experts=info.num_experts, started_at=started, ended_at=time.time()
            )
        trajectory.finish(
            Status.COMPLETED, reason="", reward=1.0, completed_version=0, completed_at=time.time()
        )
        trajectories.append(trajectory)
    await engine.aclose()
    return trajectories


def model_rows_only(trajectory: Trajectory) -> Trajectory:
    """The record as format 1 kept it: routes of model tokens only."""
    data = trajectory.to_json()
    for segment in data["segments"]:
        if segment["origin"] != Origin.MODEL.value:
            segment.pop("routed_experts", None)
    return Trajectory.from_json(data)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
async def test_replay_at_unchanged_weights_reproduces_the_engine_logprobs(family: str) -> None:
    model = model_of(family)
    trajectories = await rollouts(copy.deepcopy(model))
    learner = Learner(model, LearnerConfig(temperature=1.0))
    batch, replayed, disagreement = learner.logprobs(trajectories, replay_routes=True)
    mask = batch.loss_mask
    torch.testing.assert_close(replayed[mask], batch.behaviour[mask], atol=2e-5, rtol=0)
    assert disagreement == 0.0  # same weights: the live router agrees with the engine everywhere
    # Every input up to a row's last token replays the engine's route: prompt, tool and model ones.
    assert batch.replay is not None and batch.replay_coverage() == 1.0
    assert int(batch.replay.sum()) == sum(len(t.tokens) - 1 for t in trajectories)


async def test_replaying_every_position_reproduces_a_perturbed_engine_to_float_precision() -> None:
    """With one expert per token the gate weight is 1 whatever the logits, so replaying the engine's
    choice at every position reproduces its forward exactly, while its router's choices differ from
    the trainer's. Replaying only the model tokens' positions (format-1 records) leaves the prompt and
    the tool response on the trainer's router, and their keys and values move every later log-prob."""
    trainer_model = model_of(top_k=1)
    engine_model = copy.deepcopy(trainer_model)
    perturb_routers(engine_model)
    trajectories = await rollouts(engine_model)
    assert all(s.routed_experts is not None for t in trajectories for s in t.segments)

    def gap(records: list[Trajectory], replay: bool) -> torch.Tensor:
        batch = collate(records, 0, layers=2, top_k=1)
        with torch.no_grad():
            logprobs, _, _ = forward_logprobs(trainer_model, batch, temperature=1.0, replay_routes=replay)
        return (logprobs - batch.behaviour)[batch.loss_mask].abs()

    live, model_only, every = (
        gap(trajectories, False),
        gap([model_rows_only(t) for t in trajectories], True),
        gap(trajectories, True),
    )
    assert float(live.mean()) > 1e-2  # the engine's routers really differ from the trainer's
    assert float(model_only.mean()) > 1e-3  # and so do their choices at prompt and tool positions
    assert float(every.max()) < 2e-5  # the engine's log-probs, to float precision


def test_replay_coverage_counts_every_input_a_trained_token_depends_on() -> None:
    """Prompt [1, 2, 3] | model [4, 5] | tool [6] and prompt [7, 8] | model [9]: the trained targets
    depend on inputs 0..3 and 0..1 (6 in all). A whole-sequence record replays all 6; a format-1 one
    only the inputs that produced model tokens (2, 3 and 1: 3 of 6); none recorded, 0."""
    rows = RoutedExperts.from_array(np.tile([[[0, 1]]], (4, 1, 1)), 8)

    def record(name: str, prompt: list[int], model: list[int], tool: list[int], kept: str) -> Trajectory:
        t = Trajectory.start(name, "g", "task", prompt)
        if kept == "all":
            t.attach_routes(rows[: len(prompt) - 1], 0)
        timing = {"started_at": 0.0, "ended_at": 0.0, "finish_reason": "stop"}
        experts = rows[: len(model)] if kept != "none" else None
        t.append_model(model, [-1.0] * len(model), version=0, routed_experts=experts, **timing)  # type: ignore[arg-type]
        if tool:
            t.append_tool(tool)
        t.finish(Status.COMPLETED, reason="", reward=0.0, completed_version=0, completed_at=0.0)
        return t

    def coverage(kept: str) -> float:
        records = [record("a", [1, 2, 3], [4, 5], [6], kept), record("b", [7, 8], [9], [], kept)]
        return collate(records, 0, layers=1, top_k=2).replay_coverage()

    assert (coverage("all"), coverage("model"), coverage("none")) == (1.0, 0.5, 0.0)


async def test_replay_lowers_the_mismatch_of_a_perturbed_rollout_router() -> None:
    trainer_model = model_of()
    engine_model = copy.deepcopy(trainer_model)
    perturb_routers(engine_model)
    trajectories = await rollouts(engine_model, PROMPTS * 2)
    learner = Learner(trainer_model, LearnerConfig(temperature=1.0))
    mismatch = learner.mismatch(trajectories)
    assert mismatch["routing_disagreement"] > 0.02
    assert mismatch["mismatch_r3"] < 0.5 * mismatch["mismatch_live"]


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
    """A trajectory spanning two versions: the first call's rows (its prompt's and its tokens') and the
    second call's (its new tokens' only) sit at the input positions that produced each token."""
    model = model_of()
    engine = EmbeddedEngine(copy.deepcopy(model), config=EmbeddedEngineConfig(seed=1))
    prompt = PROMPTS[0]
    trajectory = Trajectory.start("t", "g", "task", prompt)
    outs = []
    for version in (0, 1):
        start = trajectory.routed_length
        out = await engine.generate(
            list(trajectory.tokens), SAMPLING, return_routed_experts=True, routed_experts_start_len=start
        )
        assert out.routed_experts is not None and out.routed_experts_start == start
        out = type(out)(out.tokens, out.logprobs, (version,) * len(out.tokens), out.finish_reason,
                        out.routed_experts, out.routed_experts_start)  # fmt: skip
        append_generation(trajectory, out, num_experts=8, started_at=0.0, ended_at=0.0)
        outs.append(out)
    await engine.aclose()
    first, second = outs
    assert first.routed_experts is not None and second.routed_experts is not None
    assert second.routed_experts_start == len(prompt) + len(first.tokens) - 1  # only the new positions
    assert len(second.routed_experts) == len(second.tokens)
    trajectory.finish(Status.COMPLETED, reason="", reward=0.0, completed_version=1, completed_at=0.0)
    assert [s.version for s in trajectory.segments] == [None, 0, 1]
    batch = Learner(model).collate([trajectory])
    assert batch.routes is not None and batch.replay is not None
    recorded = np.concatenate([first.routed_experts, second.routed_experts]).astype("int64")
    # The row of token p sits at input position p - 1: inputs 0 .. T - 2 replay, the last one has none.
    assert torch.equal(batch.routes[0, : len(recorded)], torch.from_numpy(recorded))
    assert int(batch.replay.sum()) == len(recorded) == len(trajectory.tokens) - 1


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
    one_past = good.clone()
    one_past[0, 3, 1, 1] = 8  # the first id past the last expert
    with pytest.raises(ValueError, match=r"\[0, 8\), got 8$"), routing_replay(model, one_past, replay):
        pass
    twice = torch.zeros_like(good)
    message = "^a recorded route names the same expert twice for one token and layer$"
    with pytest.raises(ValueError, match=message), routing_replay(model, twice, replay):
        pass
    # top_k = 3: a repeat past the first pair of a sorted row, [0, 1, 1]
    three = model_of(top_k=3)
    repeated = torch.tensor([[0, 1, 2], [0, 1, 1]]).expand(1, 4, 2, 3).clone()
    with pytest.raises(ValueError, match=message), routing_replay(three, repeated, replay):
        pass
    with pytest.raises(ValueError, match="integer"), routing_replay(model, good.float(), replay):
        pass
    shape = r"replay mask must be bool of shape \(1, 4\), got"
    with pytest.raises(ValueError, match=shape), routing_replay(model, good, replay.int()):
        pass
    with pytest.raises(ValueError, match=shape):  # routing_replay takes the shape from the mask itself
        check_routes(good, replay[:, :3], ids.shape, moe_info(model))
    with pytest.raises(ValueError, match="saw 5: run exactly"), routing_replay(model, good, replay):
        model(input_ids=torch.tensor([[5, 6, 7, 8, 9]]))
    with pytest.raises(RuntimeError, match="boom"), routing_replay(model, good, replay):
        raise RuntimeError("boom")
    assert all(not gate._forward_hooks for gate in gates)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)
    with torch.no_grad(), routing_replay(model, good, replay):
        forced = model(input_ids=ids).logits
    assert not torch.allclose(forced, before)  # the replay really decided the routing


LOGITS = (3.0, 2.0, 1.0, -1.0, 0.5, -1.5, -2.0, -3.0)
"""One token's router logits, the first `num_experts` of them: every family's live top-2 is experts 0
and 1 (DeepSeek-V3's group-limited choice too: groups (0, 1) and (4, 5) lead)."""


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _softmax_case(renormalised: bool, experts: int) -> tuple[list[float], list[float], list[float]]:
    """Softmax over all experts' logits, taken at the recorded ones: [2, 3] (logits 1, -1) and [1, 0]
    (2, 3), renormalised over them or not; and d w(expert 2) / d logits for the first pair."""
    z = sum(math.exp(x) for x in LOGITS[:experts])
    p = [math.exp(x) / z for x in LOGITS[:experts]]
    if renormalised:  # exp(1) / (exp(1) + exp(-1)) = sigmoid(2): only the two logits count
        w = sigmoid(2.0)
        grad = [0.0, 0.0, w * (1 - w), -w * (1 - w), *[0.0] * (experts - 4)]
        return [w, 1 - w], [sigmoid(-1.0), sigmoid(1.0)], grad
    # un-renormalised: p_2 itself; d p_2 / d l_e = p_2 (δ_e2 - p_e), every logit counts
    grad = [p[2] * (float(e == 2) - p[e]) for e in range(experts)]
    return [p[2], p[3]], [p[1], p[0]], grad


def _sigmoid_case() -> tuple[list[float], list[float], list[float]]:
    """DeepSeek-V3 (8 experts, norm_topk_prob, routed_scaling_factor 2.5): 2.5 σ(l_i) / Σ_chosen σ(l_j).
    For [2, 3] the sigmoids sum to 1 (σ(1) + σ(-1)), so the weights are 2.5 σ(1), 2.5 σ(-1); with
    s2 = σ(1), s3 = σ(-1): d/dl2 = 2.5 s2 (1 - s2) s3, d/dl3 = -2.5 s2 s3 (1 - s3)."""
    s2, s3, s1, s0 = sigmoid(1.0), sigmoid(-1.0), sigmoid(2.0), sigmoid(3.0)
    grad = [0.0, 0.0, 2.5 * s2 * (1 - s2) * s3, -2.5 * s2 * s3 * (1 - s3), 0.0, 0.0, 0.0, 0.0]
    return [2.5 * s2, 2.5 * s3], [2.5 * s1 / (s1 + s0), 2.5 * s0 / (s1 + s0)], grad


GATE_CASES = {
    "qwen3_moe": _softmax_case(renormalised=True, experts=6),  # norm_topk_prob: [0.8808, 0.1192]
    "qwen2_moe": _softmax_case(renormalised=False, experts=6),  # no norm_topk_prob: [0.0835, 0.0113]
    "granitemoe": _softmax_case(renormalised=True, experts=6),  # softmax over the chosen logits
    "deepseek_v3": _sigmoid_case(),  # [1.8276, 0.6724]
}
"""Per family: the gate weights of recorded [2, 3], of recorded [1, 0], and d w(expert 2) / d logits."""


@pytest.mark.parametrize("family", list(GATE_CASES))
def test_replayed_experts_get_the_live_logits_gate_weights_by_hand(family: str) -> None:
    """top_k = 2, three positions with the same logits (`LOGITS`): the first replays experts [2, 3],
    which the live router would not choose; the second [1, 0], the live set in another order; the
    third has no recorded row and keeps the live choice. The replayed weights are the family's router
    arithmetic on the live logits over the recorded experts (docs/algorithms.md §4), not the weights of
    the experts the live router chose, and their gradient reaches the router's weight."""
    from tests.agents.helpers import build_tiny

    model = build_tiny(family)
    info = moe_info(model)
    experts, layers = info.num_experts, info.num_layers
    recorded = torch.tensor([[2, 3], [1, 0], [4, 5]])  # the third row is not replayed
    routes = recorded[None, :, None, :].expand(1, 3, layers, 2).clone()
    replay = torch.tensor([[True, True, False]])
    first, second, grad = GATE_CASES[family]
    hidden = torch.zeros(3, info.gates[0].get_parameter("weight").shape[1])
    hidden[:, :experts] = torch.tensor(LOGITS[:experts])
    with torch.no_grad():  # every router's logits are the first `experts` entries of its input
        for gate in info.gates:
            gate.get_parameter("weight").copy_(torch.eye(experts, hidden.shape[1]))
            if family == "deepseek_v3":  # the bias only steers the choice; 0 keeps the top-2 at 0, 1
                gate.get_buffer("e_score_correction_bias").zero_()
        live = [gate(hidden) for gate in info.gates]
    with routing_replay(model, routes, replay) as stats:
        for gate, (_, live_scores, live_chosen) in zip(info.gates, live, strict=True):
            logits, scores, chosen = gate(hidden)
            assert sorted(live_chosen[0].tolist()) == [0, 1]
            torch.testing.assert_close(logits, hidden[:, :experts], rtol=0, atol=0)
            assert chosen[:2].tolist() == [[2, 3], [1, 0]]
            assert torch.equal(chosen[2], live_chosen[2])
            torch.testing.assert_close(scores[:2], torch.tensor([first, second]), rtol=0, atol=1e-6)
            torch.testing.assert_close(scores[2], live_scores[2], rtol=0, atol=0)  # the live router's own
            weight = gate.get_parameter("weight")
            torch.autograd.backward(scores[0, 0])
            assert weight.grad is not None
            expected = torch.outer(torch.tensor(grad), hidden[0])  # d w / d weight = d w / d logits ⊗ input
            torch.testing.assert_close(weight.grad, expected, rtol=0, atol=1e-6)
    # Each layer adds its two replayed positions, one of which (the first) disagrees with the live choice.
    assert (stats.replayed_rows, stats.disagreeing_rows) == (2 * layers, layers)
    assert stats.layers_seen == set(range(layers)) and stats.disagreement == 0.5


def test_replaying_the_live_choice_gives_the_live_weights_bit_for_bit_in_bfloat16() -> None:
    """A bfloat16 model: the routers compute their softmax in float32 and hand the experts bfloat16
    weights; replayed weights come back in the router's dtype, so replaying its own choice gives its
    own weights to the last bit."""
    model = model_of().to(torch.bfloat16)
    info = moe_info(model)
    hidden = torch.randn(6, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        live = [gate(hidden) for gate in info.gates]
        routes = torch.stack([chosen for _, _, chosen in live], dim=1).reshape(1, 6, info.num_layers, 2)
        with routing_replay(model, routes, torch.ones(1, 6, dtype=torch.bool)) as stats:
            replayed = [gate(hidden) for gate in info.gates]
    assert stats.replayed_rows == 6 * info.num_layers and stats.disagreeing_rows == 0
    for (_, live_scores, live_chosen), (_, scores, chosen) in zip(live, replayed, strict=True):
        assert scores.dtype == live_scores.dtype == torch.bfloat16
        assert torch.equal(scores, live_scores) and torch.equal(chosen, live_chosen)


def test_gradient_checkpointing_changes_memory_not_the_update() -> None:
    """A step with `learner.gradient_checkpointing` (each layer recomputed in the backward) updates a
    dense model's weights as the plain step does, and reports the same figures; an MoE is refused (the
    recomputation would route without R3's recorded experts)."""
    model = tiny_dense()
    groups = ragged_groups(model)[:3]
    outcomes = []
    for checkpointing in (False, True):
        trained = copy.deepcopy(model)
        config = LearnerConfig(lr=1e-2, gradient_checkpointing=checkpointing, micro_batch_size=3)
        result = Learner(trained, config).train_step(groups)
        assert result.updated and trained.is_activation_checkpointing == checkpointing
        outcomes.append((result.metrics, [p.detach().clone() for p in trained.parameters()]))
    (plain, plain_weights), (recomputed, recomputed_weights) = outcomes
    assert any(not torch.equal(a, b) for a, b in zip(plain_weights, model.parameters(), strict=True))
    for a, b in zip(plain_weights, recomputed_weights, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for key in ("loss", "grad_norm", "clip_fraction", "entropy", "mismatch"):
        assert recomputed[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-7), key
    with pytest.raises(ValueError, match="gradient_checkpointing works on dense models, not on the MoE"):
        Learner(model_of(), LearnerConfig(gradient_checkpointing=True))
    with pytest.raises(ValueError, match="gradient_checkpointing: Sequential does not support it"):
        Learner(torch.nn.Sequential(torch.nn.Linear(2, 2)), LearnerConfig(gradient_checkpointing=True))
