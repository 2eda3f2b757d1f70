"""R3 through SGLang for MoE models with dense layers (DeepSeek-V3's `first_k_dense_replace`, Qwen-MoE's
`mlp_only_layers` and `decoder_sparse_step`), against the stand-in (tests/sglang_standin.py), which answers
as SGLang 0.5.23 does: one column per decoder layer, the columns of layers without a router left zero.

The client keeps the columns of the trained model's MoE layers, so every family's routes recorded through
SGLang equal a plain forward's and replay bit for bit; a Qwen-MoE checkpoint with dense layers, which
SGLang 0.5.23 builds sparse throughout, is refused for R3 before any request."""

from __future__ import annotations

import base64
import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoConfig, PreTrainedModel

from pacerl.agents.engine.embedded import EmbeddedEngine
from pacerl.agents.engine.protocol import SamplingParams
from pacerl.agents.engine.sglang import SGLangEngine, SGLangOptions
from pacerl.agents.engine.sglang_layout import SGLangLayoutError, routed_layers
from pacerl.agents.engine.sglang_protocol import SGLangProtocolError
from pacerl.agents.models import MOE_FAMILIES, load_model, moe_info, save_model
from pacerl.agents.rollout import RolloutConfig, RolloutDriver
from pacerl.agents.tokenizer import tiny_tokenizer
from pacerl.agents.trajectory import Trajectory
from pacerl.envs import load_tasks
from pacerl.envs.code_math import CodeMathEnv
from pacerl.trainer.batch import collate, forward_logprobs
from pacerl.trainer.learner import Learner, LearnerConfig
from tests.agents.helpers import TINY, build_tiny, common_sizes, plain_routes
from tests.helpers import ThreadServer
from tests.sglang_standin import as_sglang_builds, create_standin_app

GREEDY = SamplingParams(max_new_tokens=6, temperature=0)


@contextmanager
def standin(model: PreTrainedModel, checkpoint: Path, served: PreTrainedModel | None = None) -> Iterator[str]:
    """A stand-in serving `served` (default: `model`) whose `/model_info` reports `checkpoint`, where
    `model` is saved: the URL."""
    save_model(model, tiny_tokenizer(), checkpoint)
    engine = EmbeddedEngine(served if served is not None else copy.deepcopy(model), tiny_tokenizer())
    app = create_standin_app(engine, model_path=str(checkpoint), weight_version="0")
    with ThreadServer(app) as server:
        yield server.url


async def raw_routes(url: str, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """What the server itself answers to a greedy `/generate` with routes: (tokens, the routed-experts
    bytes as int32, flat)."""
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0},
        "return_routed_experts": True,
    }
    async with httpx.AsyncClient(base_url=url) as http:
        answer = (await http.post("/generate", json=body)).json()
    raw = base64.b64decode(answer["meta_info"]["routed_experts"])
    return list(answer["output_ids"]), np.frombuffer(raw, dtype="<i4")


# -- what the server answers ----------------------------------------------------------------------------


async def test_the_standin_answers_every_decoder_layer_with_dense_layers_zero(tmp_path: Path) -> None:
    """SGLang's capture buffers are `[tokens, num_hidden_layers, top_k]`, zero-filled, and only MoE
    layers' top-k writes into them: DeepSeek-V3's dense layer 0 comes back as zeros."""
    model = build_tiny("deepseek_v3")  # 3 layers, first_k_dense_replace 1
    assert moe_info(model).layers == (1, 2)
    prompt = [5, 17, 40, 41, 9]
    with standin(model, tmp_path / "ckpt") as url:
        tokens, flat = await raw_routes(url, prompt)
    rows = len(prompt) + len(tokens) - 1
    routes = flat.reshape(rows, 3, 2)  # every decoder layer, top_k 2
    assert not routes[:, 0].any()
    np.testing.assert_array_equal(routes[:, 1:], plain_routes(model, prompt + tokens[:-1]))


async def test_a_qwen_moe_with_dense_layers_is_served_sparse_throughout(tmp_path: Path) -> None:
    """SGLang 0.5.23 builds every Qwen2-MoE layer sparse and skips a dense layer's weights: the
    stand-in serves a model only as SGLang builds it, and layer 0's router then routes like any."""
    model = build_tiny("qwen2_moe", mlp_only_layers=[0])
    assert moe_info(model).layers == (1,)
    with pytest.raises(ValueError, match=r"SGLang 0\.5\.23 builds .* layers \[0, 1\].*as_sglang_builds"):
        create_standin_app(EmbeddedEngine(model))
    served = as_sglang_builds(model)
    assert moe_info(served).layers == (0, 1)
    loaded = served.state_dict()
    for name, tensor in model.state_dict().items():  # what both have is the checkpoint's
        if name in loaded:
            assert torch.equal(loaded[name], tensor), name
    assert "model.layers.0.mlp.gate_proj.weight" not in loaded  # the dense MLP is not loaded
    prompt = [5, 17, 40, 41, 9]
    with standin(model, tmp_path / "ckpt", served) as url:
        tokens, flat = await raw_routes(url, prompt)
    routes = flat.reshape(len(prompt) + len(tokens) - 1, 2, 2)
    np.testing.assert_array_equal(routes, plain_routes(served, prompt + tokens[:-1]))
    assert (routes[:, 0, 0] != routes[:, 0, 1]).all()  # real top-2 sets at the checkpoint's dense layer


# -- the client --------------------------------------------------------------------------------------------


async def sglang_rollouts(url: str, num_experts: int) -> list[Trajectory]:
    """A group of two CodeMath episodes generated through the SGLang client, routes recorded."""
    tokenizer = tiny_tokenizer()
    task = load_tasks("codemath-val")[0]
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3, stop_strings=("</tool_call>",))
    # No tool schemas in the prompt: they would not fit the tiny models' 256 positions.
    config = RolloutConfig(
        group_size=2, sampling=sampling, max_total_tokens=256, on_failure="keep", tool_schemas_in_prompt=False
    )
    client = SGLangEngine(SGLangOptions(url=url))
    driver = RolloutDriver(
        client, tokenizer, lambda: CodeMathEnv(tasks=[task]), config, num_experts=num_experts
    )
    try:
        group = await driver.rollout_group(task)
    finally:
        await client.aclose()
    return group


@pytest.mark.parametrize("family", MOE_FAMILIES)
async def test_r3_through_sglang_replays_each_familys_moe_layers_bit_for_bit(
    family: str, tmp_path: Path
) -> None:
    """Episodes through the client and the stand-in: the recorded routes are a plain forward's at the
    trained model's MoE layers (DeepSeek-V3: layers 1 and 2 of 3), replaying them reproduces the plain
    forward's log-probs bit for bit, and a learner step trains with every input replayed."""
    with standin(build_tiny(family), tmp_path / "ckpt") as url:
        model, _ = load_model(tmp_path / "ckpt")
        info = moe_info(model)
        group = await sglang_rollouts(url, info.num_experts)
    assert all(t.num_model_tokens > 0 for t in group), [t.status_reason for t in group]
    for trajectory in group:
        recorded = trajectory.routed_experts()
        assert recorded is not None
        positions, experts = recorded
        tokens = list(trajectory.tokens)
        assert experts.indices.shape == (len(tokens) - 1, info.num_layers, info.top_k)
        expected = plain_routes(model, tokens[:-1])
        np.testing.assert_array_equal(experts.indices, expected[positions - 1])
    batch = collate(group, 0, layers=info.num_layers, top_k=info.top_k)
    with torch.no_grad():
        plain, _, _ = forward_logprobs(model, batch, temperature=1.0, replay_routes=False)
        replayed, _, stats = forward_logprobs(model, batch, temperature=1.0, replay_routes=True)
    assert (
        stats is not None and stats.disagreement == 0.0 and stats.layers_seen == set(range(info.num_layers))
    )
    mask = batch.loss_mask
    assert bool(mask.any()) and torch.equal(replayed[mask], plain[mask])
    for trajectory, reward in zip(group, (1.0, 0.0), strict=True):  # a group with signal to train on
        trajectory.reward = reward
    result = Learner(model, LearnerConfig(routing_replay=True, temperature=1.0, lr=1e-3)).train_step([group])
    assert result.updated, result.skipped
    assert result.metrics["r3_coverage"] == 1.0 and result.metrics["routing_disagreement"] == 0.0


@pytest.mark.parametrize(
    ("family", "changes", "knob"),
    [
        ("qwen2_moe", {"mlp_only_layers": [0]}, "mlp_only_layers"),
        ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ],
)
async def test_r3_through_sglang_refuses_a_qwen_moe_with_dense_layers(
    family: str, changes: dict[str, Any], knob: str, tmp_path: Path
) -> None:
    model = build_tiny(family, **changes)
    assert moe_info(model).layers == (1,)
    paths: list[str] = []

    async def record(request: httpx.Request) -> None:
        paths.append(request.url.path)

    message = rf"SGLang 0\.5\.23 builds layers \[0, 1\] of this {family}.*{knob}.*MoE layers are \[1\]"
    with standin(model, tmp_path / "ckpt", as_sglang_builds(model)) as url:
        client = SGLangEngine(SGLangOptions(url=url))
        client._transport.client = httpx.AsyncClient(event_hooks={"request": [record]})
        with pytest.raises(SGLangLayoutError, match=message):
            await client.generate([5, 6, 7], GREEDY, return_routed_experts=True)
        await client.aclose()
        assert paths == ["/model_info"]  # refused before generating
        # A rollout does not take it for a failed request (retried, then a failed episode): it ends.
        with pytest.raises(SGLangLayoutError, match=message):
            await sglang_rollouts(url, 6)


async def test_sglang_num_layers_counts_decoder_layers_and_moe_layers_picks_columns(tmp_path: Path) -> None:
    """`sglang.num_layers` is the model's `num_hidden_layers` (SGLang's columns), checked against a
    readable config; without one, `moe_layers` names the columns kept, else every column is."""
    model = build_tiny("deepseek_v3")
    checkpoint = tmp_path / "ckpt"
    save_model(model, tiny_tokenizer(), checkpoint)
    prompt = [5, 17, 40, 41, 9]
    engine = EmbeddedEngine(copy.deepcopy(model), tiny_tokenizer())
    with ThreadServer(create_standin_app(engine, weight_version="0")) as server:  # no readable config
        client = SGLangEngine(SGLangOptions(url=server.url))
        with pytest.raises(SGLangProtocolError, match=r"set SGLangOptions\.num_layers"):
            await client.generate(prompt, GREEDY, return_routed_experts=True)
        await client.aclose()
        for options in (
            {"num_layers": 3, "top_k": 2, "num_experts": 8, "moe_layers": (1, 2)},
            {"base_model_dir": str(checkpoint)},  # the checkpoint's config.json read here
        ):
            client = SGLangEngine(SGLangOptions(url=server.url, **options))
            got = await client.generate(prompt, GREEDY, return_routed_experts=True)
            await client.aclose()
            assert got.routed_experts is not None
            np.testing.assert_array_equal(
                got.routed_experts, plain_routes(model, prompt + list(got.tokens)[:-1])
            )
        # Every column kept: the dense layer's zeros come along, which the learner refuses by shape.
        client = SGLangEngine(SGLangOptions(url=server.url, num_layers=3, top_k=2))
        got = await client.generate(prompt, GREEDY, return_routed_experts=True)
        await client.aclose()
        assert got.routed_experts is not None and got.routed_experts.shape[1:] == (3, 2)
        assert not got.routed_experts[:, 0].any()
        # Too few columns for what the server sends is a protocol error naming the count.
        client = SGLangEngine(SGLangOptions(url=server.url, num_layers=2, top_k=2))
        with pytest.raises(SGLangProtocolError, match=r"x 2 layers x top_k 2"):
            await client.generate(prompt, GREEDY, return_routed_experts=True)
        await client.aclose()
    with standin(model, checkpoint) as url:  # a readable config.json: the options must agree with it
        client = SGLangEngine(SGLangOptions(url=url, num_layers=2))
        with pytest.raises(SGLangLayoutError, match=r"num_layers=2.*num_hidden_layers = 3"):
            await client.generate(prompt, GREEDY, return_routed_experts=True)
        await client.aclose()
        client = SGLangEngine(SGLangOptions(url=url, moe_layers=(0, 1)))
        with pytest.raises(SGLangLayoutError, match=r"moe_layers=\(0, 1\).*\(1, 2\)"):
            await client.generate(prompt, GREEDY, return_routed_experts=True)
        await client.aclose()


async def test_a_nonzero_dense_column_is_a_protocol_error(tmp_path: Path) -> None:
    """A server that routes at a layer the config makes dense does not run this checkpoint: the
    client says so rather than drop the column."""
    model = build_tiny("deepseek_v3")
    checkpoint = tmp_path / "ckpt"
    save_model(model, tiny_tokenizer(), checkpoint)
    # The stand-in serves all three layers as MoE layers, its config saying layer 0 is dense.
    everywhere = build_tiny("deepseek_v3", first_k_dense_replace=0)
    engine = EmbeddedEngine(everywhere, tiny_tokenizer())
    with ThreadServer(create_standin_app(engine, weight_version="0")) as server:
        client = SGLangEngine(SGLangOptions(url=server.url, base_model_dir=str(checkpoint)))
        with pytest.raises(SGLangProtocolError, match=r"nonzero expert ids at layer 0.*dense"):
            await client.generate([5, 17, 40, 41, 9], GREEDY, return_routed_experts=True)
        await client.aclose()


def deepseek_config(directory: Path, **changes: Any) -> Path:
    sizes = common_sizes(len(tiny_tokenizer()))
    AutoConfig.for_model("deepseek_v3", **{**sizes, **TINY["deepseek_v3"], **changes}).save_pretrained(
        directory
    )
    return directory


@pytest.mark.parametrize(
    ("changes", "layers"),
    [
        ({}, (1, 2)),
        ({"first_k_dense_replace": 0}, (0, 1, 2)),
        ({"first_k_dense_replace": 2}, (2,)),
        ({"num_hidden_layers": 5, "first_k_dense_replace": 3, "moe_layer_freq": 1}, (3, 4)),
    ],
)
def test_routed_layers_of_deepseek_v3_follow_first_k_dense_replace(
    changes: dict[str, Any], layers: tuple[int, ...], tmp_path: Path
) -> None:
    assert routed_layers(deepseek_config(tmp_path, **changes)) == layers


def test_routed_layers_refuse_what_sglang_and_transformers_build_differently(tmp_path: Path) -> None:
    # SGLang keeps every moe_layer_freq-th layer sparse; transformers' DeepSeek-V3 ignores the key.
    with pytest.raises(SGLangLayoutError, match=r"builds layers \[2\] of this deepseek_v3.*\[1, 2\]"):
        routed_layers(deepseek_config(tmp_path, moe_layer_freq=2))
