"""Sparse upcycling (`pacerl.agents.upcycle`): a tiny random Llama (and Mistral) turned into a Mixtral-layout
MoE gives the dense model's logits for whatever its routers choose and for any routes R3 replays; its
weights are the dense model's, its routers new and seeded; the engine records its routes, R3 replays
them and the learner trains it; `pacerl upcycle` writes it as a checkpoint; other families are refused."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import MixtralForCausalLM

from pacerl.agents.engine.embedded import EmbeddedEngine
from pacerl.agents.models import load_model, moe_info, save_model
from pacerl.agents.tokenizer import tiny_tokenizer
from pacerl.agents.upcycle import DEFAULT_ROUTER_STD, UPCYCLABLE, upcycle_to_mixtral
from pacerl.cli import _ROUTER_STD
from pacerl.cli import main as pacerl_main
from pacerl.trainer.batch import collate, forward_logprobs
from pacerl.trainer.learner import Learner, LearnerConfig
from pacerl.trainer.replay import routing_replay
from tests.agents.helpers import PROMPTS, SAMPLING, plain_routes, rollouts, tiny_dense

TOKENS = torch.tensor(
    [[5, 17, 40, 41, 9, 7, 8, 100, 101, 102, 103, 12], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]
)
"""Two rows of 12 input ids of the tiny tokenizer's vocabulary."""


def logits(model: torch.nn.Module, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=tokens).logits
    return out


def routes_of(model: torch.nn.Module, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    """`[B, T, layers, top_k]`: what the live routers choose in one forward over `tokens`."""
    info = moe_info(model)
    seen: dict[int, torch.Tensor] = {}
    handles = [
        gate.register_forward_hook(lambda _m, _i, out, layer=layer: seen.__setitem__(layer, out[2]))
        for layer, gate in enumerate(info.gates)
    ]
    try:
        logits(model, tokens)
    finally:
        for handle in handles:
            handle.remove()
    stacked = torch.stack([seen[layer] for layer in range(info.num_layers)], dim=1)
    return stacked.reshape(*tokens.shape, info.num_layers, info.top_k)


def random_routes(shape: tuple[int, ...], num_experts: int, top_k: int, seed: int) -> torch.Tensor:
    """`[*shape, top_k]` expert ids, distinct within each row, drawn uniformly."""
    generator = torch.Generator().manual_seed(seed)
    rows = int(np.prod(shape))
    ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(rows)])
    return ids.reshape(*shape, top_k)


def perturb_expert(moe: MixtralForCausalLM, expert: int) -> None:
    """Move one expert of every layer off the dense MLP, as training would."""
    with torch.no_grad():
        for layer in moe.model.layers:
            layer.mlp.experts.down_proj[expert].mul_(3.0)


# -- identity at initialisation, for any routing ------------------------------------------------------------


@pytest.mark.parametrize("num_experts", [4, 8])
@pytest.mark.parametrize("top_k", [1, 2])
def test_the_upcycled_model_gives_the_dense_logits_whatever_its_random_routers_choose(
    num_experts: int, top_k: int
) -> None:
    dense = tiny_dense()
    expected = logits(dense)
    chosen: list[torch.Tensor] = []
    for seed in range(3):
        # A router std of 1 gives decisive, seed-dependent routes (0.02 would do too; it is just flatter).
        moe = upcycle_to_mixtral(dense, num_experts, top_k, router_init_std=1.0, seed=seed)
        info = moe_info(moe)
        assert (info.family, info.num_experts, info.top_k, info.num_layers) == (
            "mixtral",
            num_experts,
            top_k,
            3,
        )
        torch.testing.assert_close(logits(moe), expected, atol=2e-5, rtol=0)
        chosen.append(routes_of(moe))
    # Not vacuous: each model spreads tokens over several experts, and the seeds route differently.
    assert all(len(torch.unique(routes)) > 1 for routes in chosen)
    assert not torch.equal(chosen[0], chosen[1]) and not torch.equal(chosen[1], chosen[2])


@pytest.mark.parametrize(("num_experts", "top_k"), [(4, 1), (4, 2), (8, 2)])
def test_replaying_arbitrary_routes_gives_the_dense_logits_and_a_trained_expert_would_change_them(
    num_experts: int, top_k: int
) -> None:
    dense = tiny_dense()
    expected = logits(dense)
    moe = upcycle_to_mixtral(dense, num_experts, top_k, seed=1)
    replay = torch.ones(TOKENS.shape, dtype=torch.bool)
    for seed in range(3):
        routes = random_routes((*TOKENS.shape, 3), num_experts, top_k, seed)
        with routing_replay(moe, routes, replay) as stats:
            replayed = logits(moe)
        assert stats.replayed_rows == TOKENS.numel() * 3 and stats.layers_seen == {0, 1, 2}
        assert stats.disagreement > 0  # the replayed routes are not the live router's
        torch.testing.assert_close(replayed, expected, atol=2e-5, rtol=0)
    # The same replay through a model whose expert 0 moved off the dense MLP is no longer the dense model:
    # the identity comes from the copied experts, not from the replay ignoring its routes.
    perturb_expert(moe, 0)
    routes = random_routes((*TOKENS.shape, 3), num_experts, top_k, 0)
    routes[..., 0] = 0  # expert 0 first in every row
    if top_k > 1:
        routes[..., 1] = torch.where(routes[..., 1] == 0, 1, routes[..., 1])  # still distinct
    with routing_replay(moe, routes, replay):
        moved = logits(moe)
    assert float((moved - expected).abs().max()) > 1e-3  # 50 times the identity's tolerance


def test_a_mistral_with_a_sliding_window_keeps_its_window_and_its_logits() -> None:
    dense = tiny_dense("mistral", sliding_window=4)  # shorter than the 12 tokens: the window matters
    moe = upcycle_to_mixtral(dense, 4, 2, router_init_std=1.0)
    assert moe.config.sliding_window == 4
    torch.testing.assert_close(logits(moe), logits(dense), atol=2e-5, rtol=0)
    no_window = copy.deepcopy(moe)
    no_window.config.sliding_window = None
    assert float((logits(no_window) - logits(dense)).abs().max()) > 1e-3


# -- what is copied and what is new -------------------------------------------------------------------------


def test_weights_are_the_dense_models_and_the_routers_are_new_seeded_and_leave_the_rng_alone() -> None:
    dense = tiny_dense()
    state = dense.state_dict()
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    moe = upcycle_to_mixtral(dense, 4, 2, router_init_std=0.05, seed=7)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert moe.dtype == torch.float32 and not moe.training
    config = moe.config
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (32, 48, 3)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 8)
    assert (
        config.rope_parameters == {"rope_type": "default", "rope_theta": 500.0}
        and config.rms_norm_eps == 1e-3
    )
    assert config.tie_word_embeddings and config.sliding_window is None
    assert (config.num_local_experts, config.num_experts_per_tok, config.router_jitter_noise) == (4, 2, 0.0)
    moe_state = moe.state_dict()
    for name, tensor in state.items():
        if ".mlp." not in name:
            assert torch.equal(moe_state[name], tensor), name
    assert moe.lm_head.weight.data_ptr() == moe.model.embed_tokens.weight.data_ptr()  # still tied
    assert moe.model.embed_tokens.weight.data_ptr() != dense.model.embed_tokens.weight.data_ptr()  # a copy
    routers = []
    for index, layer in enumerate(moe.model.layers):
        experts = layer.mlp.experts
        gate = state[f"model.layers.{index}.mlp.gate_proj.weight"]
        up = state[f"model.layers.{index}.mlp.up_proj.weight"]
        down = state[f"model.layers.{index}.mlp.down_proj.weight"]
        assert experts.gate_up_proj.shape == (4, 96, 32) and experts.down_proj.shape == (4, 32, 48)
        for expert in range(4):
            assert torch.equal(experts.gate_up_proj[expert], torch.cat([gate, up]))
            assert torch.equal(experts.down_proj[expert], down)
        assert experts.gate_up_proj[0].data_ptr() != experts.gate_up_proj[1].data_ptr()  # own storage
        routers.append(layer.mlp.gate.weight.detach().clone())
    # Expert 1 trains on its own: changing it leaves expert 0 as it was.
    with torch.no_grad():
        moe.model.layers[0].mlp.experts.down_proj[1].zero_()
    assert torch.equal(
        moe.model.layers[0].mlp.experts.down_proj[0], state["model.layers.0.mlp.down_proj.weight"]
    )
    every = torch.cat(routers)
    assert 0.04 < float(every.std()) < 0.06 and abs(float(every.mean())) < 0.01
    assert not torch.equal(routers[0], routers[1])  # each layer its own draw
    again = upcycle_to_mixtral(dense, 4, 2, router_init_std=0.05, seed=7)
    other = upcycle_to_mixtral(dense, 4, 2, router_init_std=0.05, seed=8)
    assert all(torch.equal(a.mlp.gate.weight, r) for a, r in zip(again.model.layers, routers, strict=True))
    assert not torch.equal(other.model.layers[0].mlp.gate.weight, routers[0])


def test_a_bfloat16_model_upcycles_in_bfloat16() -> None:
    dense = tiny_dense(dtype=torch.bfloat16)
    moe = upcycle_to_mixtral(dense, 4, 1)
    assert moe.dtype == torch.bfloat16 and moe.model.layers[0].mlp.gate.weight.dtype == torch.bfloat16
    assert torch.equal(
        moe.model.layers[2].mlp.experts.down_proj[3], dense.model.layers[2].mlp.down_proj.weight
    )
    # Close, not equal: the experts multiply the tokens routed to them, other shapes than the dense MLP's,
    # and bfloat16 rounds each shape's sums its own way.
    torch.testing.assert_close(logits(moe), logits(dense), atol=1e-2, rtol=0)


@pytest.mark.parametrize(
    ("family", "changes", "message"),
    [
        ("qwen2", {}, r"Llama-family model \(llama, mistral\), got model_type 'qwen2'"),
        ("qwen3", {}, r"model_type 'qwen3'"),
        ("llama", {"attention_bias": True}, r"attention_bias=True"),
        ("llama", {"mlp_bias": True}, r"mlp_bias=True"),
        ("mixtral", {"num_local_experts": 4}, r"model_type 'mixtral'"),
    ],
)
def test_other_families_and_biases_are_refused(family: str, changes: dict[str, Any], message: str) -> None:
    assert "llama" in UPCYCLABLE
    with pytest.raises(ValueError, match=message):
        upcycle_to_mixtral(tiny_dense(family, **changes), 4, 2)


@pytest.mark.parametrize(
    ("num_experts", "top_k", "std", "message"),
    [
        (0, 1, 0.02, "num_experts must be >= 1"),
        (4, 0, 0.02, r"top_k must lie in \[1, num_experts=4\]"),
        (4, 5, 0.02, r"top_k must lie in \[1, num_experts=4\], got 5"),
        (4, 2, -0.1, "router_init_std must be a finite number >= 0"),
        (4, 2, float("nan"), "router_init_std must be a finite number >= 0"),
    ],
)
def test_bad_sizes_are_refused(num_experts: int, top_k: int, std: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        upcycle_to_mixtral(tiny_dense(), num_experts, top_k, router_init_std=std)


# -- R3 and the adapters on the result -----------------------------------------------------------------------


async def test_the_engine_records_r3_replays_and_the_learner_trains_the_upcycled_model(
    tmp_path: Path,
) -> None:
    dense = tiny_dense()
    # Decisive routers: a near-tie could flip between a prefill and a cached decode in the last bit.
    upcycled = upcycle_to_mixtral(dense, 4, 2, router_init_std=1.0, seed=2)
    model, _ = load_model(save_model(upcycled, tiny_tokenizer(), tmp_path / "moe"))
    assert type(model) is MixtralForCausalLM
    info = moe_info(model)
    assert (info.family, info.num_experts, info.top_k, info.layers) == ("mixtral", 4, 2, (0, 1, 2))
    torch.testing.assert_close(logits(model), logits(dense), atol=2e-5, rtol=0)  # saved and loaded whole

    engine = EmbeddedEngine(copy.deepcopy(model))
    result = await engine.generate(PROMPTS[1], SAMPLING, return_routed_experts=True)
    await engine.aclose()
    assert result.routed_experts is not None
    tokens = PROMPTS[1] + list(result.tokens)
    recorded = np.asarray(result.routed_experts)
    assert recorded.shape == (len(tokens) - 1, 3, 2)
    np.testing.assert_array_equal(recorded, plain_routes(model, tokens[:-1]))  # the engine's = a forward's
    assert len({tuple(row) for row in recorded.reshape(len(recorded), -1).tolist()}) > 1

    trajectories = await rollouts(copy.deepcopy(model))
    batch = collate(trajectories, 0, layers=info.num_layers, top_k=info.top_k)
    with torch.no_grad():
        replayed, _, stats = forward_logprobs(model, batch, temperature=1.0, replay_routes=True)
    assert stats is not None and stats.disagreement == 0.0 and stats.layers_seen == {0, 1, 2}
    mask = batch.loss_mask
    torch.testing.assert_close(replayed[mask], batch.behaviour[mask], atol=5e-5, rtol=0)

    # One R3 step trains routers and experts: the experts, identical at the start, part ways.
    learner = Learner(model, LearnerConfig(routing_replay=True, temperature=1.0, lr=1e-2))
    step = learner.train_step([trajectories])
    assert step.updated, step.skipped
    assert step.metrics["r3_coverage"] == 1.0 and step.metrics["routing_disagreement"] == 0.0
    for layer in model.model.layers:
        down = layer.mlp.experts.down_proj
        assert any(not torch.equal(down[0], down[expert]) for expert in range(1, 4))
    assert not torch.equal(model.model.layers[0].mlp.gate.weight, upcycled.model.layers[0].mlp.gate.weight)

    # Now that the experts differ, routes matter: replay of the new engine's routes is exact, others move.
    trained = await rollouts(copy.deepcopy(model))
    batch = collate(trained, 0, layers=info.num_layers, top_k=info.top_k)
    assert batch.routes is not None
    shifted = dataclasses.replace(batch, routes=(batch.routes + 1) % info.num_experts)
    with torch.no_grad():
        replayed, _, stats = forward_logprobs(model, batch, temperature=1.0, replay_routes=True)
        moved, _, _ = forward_logprobs(model, shifted, temperature=1.0, replay_routes=True)
    mask = batch.loss_mask
    assert stats is not None and stats.disagreement == 0.0
    torch.testing.assert_close(replayed[mask], batch.behaviour[mask], atol=5e-5, rtol=0)
    assert float((moved[mask] - replayed[mask]).abs().max()) > 1e-5


# -- the command -----------------------------------------------------------------------------------------


def test_pacerl_upcycle_writes_a_checkpoint_that_starts_as_the_dense_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dense = tiny_dense()
    source = save_model(dense, tiny_tokenizer(), tmp_path / "dense")
    out = tmp_path / "moe"
    argv = ["upcycle", "--model", str(source), "--experts", "4", "--top-k", "2", "--out", str(out)]
    assert pacerl_main([*argv, "--seed", "5", "--router-std", "0.1"]) == 0
    printed = capsys.readouterr().out
    assert "4 experts, top-2" in printed and str(out) in printed
    model, tokenizer = load_model(out)
    assert type(model) is MixtralForCausalLM and moe_info(model).num_experts == 4
    assert tokenizer.get_vocab() == tiny_tokenizer().get_vocab()
    torch.testing.assert_close(logits(model), logits(dense), atol=2e-5, rtol=0)
    expected = upcycle_to_mixtral(dense, 4, 2, router_init_std=0.1, seed=5)
    assert torch.equal(model.model.layers[1].mlp.gate.weight, expected.model.layers[1].mlp.gate.weight)
    # Without --seed and --router-std: the function's defaults, which --help states.
    assert pacerl_main([*argv[:-1], str(tmp_path / "default")]) == 0
    model, _ = load_model(tmp_path / "default")
    expected = upcycle_to_mixtral(dense, 4, 2)
    assert torch.equal(model.model.layers[0].mlp.gate.weight, expected.model.layers[0].mlp.gate.weight)
    assert _ROUTER_STD == DEFAULT_ROUTER_STD


def test_pacerl_upcycle_refuses_a_model_it_cannot_upcycle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = save_model(tiny_dense("qwen2"), tiny_tokenizer(), tmp_path / "qwen2")
    out = tmp_path / "moe"
    code = pacerl_main(
        ["upcycle", "--model", str(source), "--experts", "4", "--top-k", "2", "--out", str(out)]
    )
    assert code == 2
    assert "upcycling takes a dense Llama-family model" in capsys.readouterr().err
    assert not out.exists()
    # A directory with files in it is not written over.
    llama = save_model(tiny_dense(), tiny_tokenizer(), tmp_path / "llama")
    code = pacerl_main(
        ["upcycle", "--model", str(llama), "--experts", "4", "--top-k", "2", "--out", str(source)]
    )
    assert code == 2 and "is not an empty directory" in capsys.readouterr().err
    assert load_model(source)[0].config.model_type == "qwen2"
