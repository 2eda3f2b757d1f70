"""R3 for every MoE family with an adapter (`pacerl.agents.models.MOE_ADAPTERS`), each as a tiny random
checkpoint saved with `save_pretrained` and loaded back through `load_model`: the engine records what a plain
forward routes, replaying those routes reproduces the plain forward's log-probs exactly while other routes
change them, the learner trains with full replay coverage, and an MoE family without an adapter is a clear
error once R3 is on (a dense model stays dense)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from pacerl.agents.engine.embedded import EmbeddedEngine
from pacerl.agents.models import (
    MOE_FAMILIES,
    UnsupportedMoEError,
    check_replay_support,
    declares_moe,
    load_model,
    moe_info,
    save_model,
)
from pacerl.agents.tokenizer import tiny_tokenizer
from pacerl.agents.trajectory import Status, Trajectory
from pacerl.trainer.batch import collate, forward_logprobs
from pacerl.trainer.learner import Learner, LearnerConfig
from tests.agents.helpers import (
    PROMPTS,
    SAMPLING,
    TINY,
    UNSUPPORTED,
    build_tiny,
    common_sizes,
    plain_routes,
    rollouts,
)

REQUIRED = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss", "granitemoe")
"""The families issue 16 names; each one the installed transformers has must have an adapter."""


MOE_LAYERS = {"deepseek_v3": (1, 2)}
"""Decoder layers with a router where not (0, 1)."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every supported family as a saved checkpoint directory (save_pretrained + tokenizer)."""
    root = tmp_path_factory.mktemp("moe_families")
    return {
        family: save_model(build_tiny(family), tiny_tokenizer(), root / family) for family in MOE_FAMILIES
    }


def load(checkpoints: dict[str, Path], family: str) -> PreTrainedModel:
    model, _ = load_model(checkpoints[family])
    assert model.config.model_type == family
    return model


# -- the registry ---------------------------------------------------------------------------------------


def test_every_required_family_the_installed_transformers_has_is_supported() -> None:
    installed = [family for family in REQUIRED if family in CONFIG_MAPPING]
    assert installed == list(REQUIRED)  # transformers 5.24 has them all: a missing one is a real change
    assert set(installed) <= set(MOE_FAMILIES)
    assert set(TINY) == set(MOE_FAMILIES)  # every adapter is exercised below


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_info_finds_each_familys_routers(family: str, checkpoints: dict[str, Path]) -> None:
    model = load(checkpoints, family)
    info = moe_info(model)
    config = TINY[family]
    experts = config.get("num_experts", config.get("num_local_experts", config.get("n_routed_experts")))
    assert (info.family, info.num_experts, info.top_k) == (family, experts, 2)
    assert info.layers == MOE_LAYERS.get(family, (0, 1))
    path = info.adapter.path
    assert info.gate_names == tuple(f"model.layers.{layer}.{path}" for layer in info.layers)
    assert all(
        model.get_submodule(name) is gate for name, gate in zip(info.gate_names, info.gates, strict=True)
    )
    assert moe_info(model.model).gate_names == tuple(name.removeprefix("model.") for name in info.gate_names)
    check_replay_support(model)  # a supported family passes


# -- (a) capture, (b) replay, (c) training ----------------------------------------------------------------


@pytest.mark.parametrize("family", MOE_FAMILIES)
async def test_the_engine_records_what_a_plain_forward_routes(
    family: str, checkpoints: dict[str, Path]
) -> None:
    model = load(checkpoints, family)
    info = moe_info(model)
    engine = EmbeddedEngine(model)
    assert engine.is_moe and engine._recorder.gates == list(info.gates)
    prompt = PROMPTS[1]
    result = await engine.generate(prompt, SAMPLING, return_routed_experts=True)
    await engine.aclose()
    assert result.routed_experts is not None
    tokens = prompt + list(result.tokens)
    recorded = np.asarray(result.routed_experts)
    assert recorded.shape == (len(tokens) - 1, info.num_layers, info.top_k)
    expected = plain_routes(model, tokens[:-1])
    np.testing.assert_array_equal(recorded, expected)
    # Not a vacuous match: the routers choose differently across positions.
    assert len({tuple(row) for row in recorded.reshape(len(recorded), -1).tolist()}) > 1


@pytest.mark.parametrize("family", MOE_FAMILIES)
async def test_replaying_recorded_routes_is_exact_and_other_routes_change_the_logprobs(
    family: str, checkpoints: dict[str, Path]
) -> None:
    model = load(checkpoints, family)
    info = moe_info(model)
    trajectories = await rollouts(copy.deepcopy(model))
    batch = collate(trajectories, 0, layers=info.num_layers, top_k=info.top_k)
    assert batch.routes is not None and batch.replay is not None
    with torch.no_grad():
        plain, _, none = forward_logprobs(model, batch, temperature=1.0, replay_routes=False)
        replayed, _, stats = forward_logprobs(model, batch, temperature=1.0, replay_routes=True)
    assert none is None and stats is not None
    assert stats.layers_seen == set(range(info.num_layers)) and stats.replayed_rows > 0
    assert stats.disagreement == 0.0
    mask = batch.loss_mask
    assert torch.equal(replayed[mask], plain[mask])  # the router's own arithmetic, bit for bit
    torch.testing.assert_close(replayed[mask], batch.behaviour[mask], atol=5e-5, rtol=0)  # the engine's
    # Other experts (each shifted by one: still distinct, never the recorded set) move the log-probs.
    shifted = dataclasses.replace(batch, routes=(batch.routes + 1) % info.num_experts)
    with torch.no_grad():
        moved, _, moved_stats = forward_logprobs(model, shifted, temperature=1.0, replay_routes=True)
    # The live router, fed the hidden states the forced experts produce, rarely lands on a shifted set.
    assert moved_stats is not None and moved_stats.replayed_rows == stats.replayed_rows
    assert moved_stats.disagreement > 0.5
    assert float((moved[mask] - plain[mask]).abs().max()) > 1e-3


@pytest.mark.parametrize("family", MOE_FAMILIES)
async def test_a_learner_step_with_r3_replays_every_input(family: str, checkpoints: dict[str, Path]) -> None:
    model = load(checkpoints, family)
    trajectories = await rollouts(copy.deepcopy(model))
    learner = Learner(model, LearnerConfig(routing_replay=True, temperature=1.0, lr=1e-3))
    routers = [gate.get_parameter("weight") for gate in moe_info(model).gates]
    before = [weight.detach().clone() for weight in routers]
    result = learner.train_step([trajectories])
    assert result.updated, result.skipped
    assert result.metrics["r3_coverage"] == 1.0
    assert result.metrics["routing_disagreement"] == 0.0  # same weights as the engine
    # The routers learn through the gate weights recomputed over the replayed experts.
    assert all(not torch.equal(now, then) for now, then in zip(routers, before, strict=True))


# -- (d) an MoE without an adapter; a dense model ---------------------------------------------------------


def test_an_moe_family_without_an_adapter_is_a_clear_error_once_r3_is_on(tmp_path: Path) -> None:
    assert UNSUPPORTED in CONFIG_MAPPING and UNSUPPORTED not in MOE_FAMILIES
    tokenizer = tiny_tokenizer()
    config = AutoConfig.for_model(UNSUPPORTED, **{**common_sizes(len(tokenizer)), "num_local_experts": 4})
    save_model(AutoModelForCausalLM.from_config(config), tokenizer, tmp_path)  # type: ignore[no-untyped-call]
    model, _ = load_model(tmp_path)
    assert declares_moe(model.config)
    message = r"'phimoe' is a mixture-of-experts model.*qwen2_moe, qwen3_moe, mixtral, olmoe.*routing_replay"
    with pytest.raises(UnsupportedMoEError, match=message):
        moe_info(model)
    with pytest.raises(UnsupportedMoEError, match=message):
        check_replay_support(model)
    assert not EmbeddedEngine(model).is_moe  # it generates, recording no routes
    # The learner takes it, but its first R3 forward refuses it...
    group = [unrouted("a", 1.0), unrouted("b", 0.0)]
    with pytest.raises(UnsupportedMoEError, match=message):
        Learner(model, LearnerConfig(routing_replay=True)).train_step([group])
    # ...and without R3 it trains on its own router.
    result = Learner(model, LearnerConfig(routing_replay=False)).train_step([group])
    assert result.updated and result.metrics["r3_coverage"] == 0.0


def unrouted(name: str, reward: float) -> Trajectory:
    """A finished trajectory without recorded routes."""
    trajectory = Trajectory.start(name, "g", "task", [5, 6, 7])
    trajectory.append_model(
        [20, 21], [-2.0, -2.0], version=0, started_at=0.0, ended_at=0.0, finish_reason="stop"
    )
    trajectory.finish(Status.COMPLETED, reason="", reward=reward, completed_version=0, completed_at=0.0)
    return trajectory


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_a_dense_model_stays_dense_with_r3_a_no_op(family: str) -> None:
    tokenizer = tiny_tokenizer()
    config = AutoConfig.for_model(family, **common_sizes(len(tokenizer)))
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    assert not declares_moe(model.config)
    check_replay_support(model)
    with pytest.raises(ValueError, match="knows the MoE families") as error:
        moe_info(model)
    assert not isinstance(error.value, UnsupportedMoEError)
    assert not EmbeddedEngine(model).is_moe
    batch = collate([unrouted("a", 1.0)], 0)
    with torch.no_grad():
        on, _, stats = forward_logprobs(model, batch, temperature=1.0, replay_routes=True)
        off, _, _ = forward_logprobs(model, batch, temperature=1.0, replay_routes=False)
    assert stats is None and torch.equal(on, off)


@pytest.mark.parametrize(
    ("family", "changes", "moe"),
    [
        ("qwen2", {}, False),
        ("mixtral", {}, True),
        ("jetmoe", {}, True),  # named MoE
        ("dbrx", {}, True),  # known MoE type, experts in a sub-config
        ("qwen3_vl_moe", {}, True),  # experts in the text config
    ],
)
def test_declares_moe_reads_expert_counts_and_known_types(
    family: str, changes: dict[str, Any], moe: bool
) -> None:
    assert declares_moe(CONFIG_MAPPING[family](**changes)) is moe
