"""The SGLang client against the protocol-faithful stand-in on a loopback port: greedy output, log-probs
and routed experts equal to the embedded engine's, aborts, weight updates through disk, health, a dead
server, refusals before any request, SGLang-shaped errors, and the `pacerl serve sglang` argv. One test
talks to a real SGLang server (marked gpu; deselected by default)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from pacerl.agents.engine.embedded import ContextOverflowError, EmbeddedEngine
from pacerl.agents.engine.protocol import FinishReason, Generation, SamplingParams
from pacerl.agents.engine.sglang import SGLangEngine, SGLangOptions, launch_command
from pacerl.agents.engine.sglang_protocol import (
    SGLangProtocolError,
    SGLangRequestError,
    SGLangUnavailable,
    token_versions,
)
from pacerl.agents.models import layout_of
from pacerl.cli import main
from tests.agents.helpers import LAYOUT, StandIn, reference_greedy, tiny_moe
from tests.helpers import free_port
from tests.sglang_standin import read_safetensors

GREEDY = SamplingParams(max_new_tokens=10, temperature=0)
LONG = SamplingParams(max_new_tokens=240, temperature=0, ignore_eos=True)


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[StandIn]:
    server = StandIn(tmp_path)
    with server.server:
        yield server


async def reference(model: torch.nn.Module, prompt: list[int], sampling: SamplingParams) -> Generation:
    engine = EmbeddedEngine(model)
    try:
        return await engine.generate(prompt, sampling, return_routed_experts=True)
    finally:
        await engine.aclose()


async def test_greedy_logprobs_and_routes_equal_the_embedded_engine(standin: StandIn) -> None:
    prompts = [[5, 6, 7, 8], [9] * 7, [11, 12]]
    expected = [await reference(tiny_moe(), p, GREEDY) for p in prompts]
    client = standin.client(**LAYOUT)
    results = await asyncio.gather(*(client.generate(p, GREEDY, return_routed_experts=True) for p in prompts))
    for prompt, got, want in zip(prompts, results, expected, strict=True):
        assert got.tokens == want.tokens and got.finish_reason is want.finish_reason is FinishReason.LENGTH
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-6)
        assert got.versions == (0,) * len(got.tokens)
        assert got.routed_experts is not None and want.routed_experts is not None
        assert got.routed_experts.shape == (len(prompt) + len(got.tokens) - 1, 2, 2)
        assert got.routed_experts.dtype == np.int32
        assert np.array_equal(got.routed_experts, want.routed_experts)
    plain = await client.generate(prompts[0], GREEDY)
    assert plain.routed_experts is None and plain.tokens == expected[0].tokens
    await client.aclose()
    # Without the layout in the options, it comes from config.json at the server's model_path.
    discovering = standin.client()
    found = await discovering.generate(prompts[1], GREEDY, return_routed_experts=True)
    assert found.routed_experts is not None and expected[1].routed_experts is not None
    assert np.array_equal(found.routed_experts, expected[1].routed_experts)
    await discovering.aclose()


async def test_a_resumed_segment_asks_for_the_routes_of_new_positions_only(standin: StandIn) -> None:
    """The client sends SGLang's `routed_experts_start_len` when resuming, and the stand-in answers
    the rows from there on only: the two calls' rows together are one uninterrupted call's."""
    prompt = [3, 4, 5, 6]
    whole = await reference(tiny_moe(), prompt, GREEDY)
    bodies: list[dict[str, object]] = []

    async def record(request: httpx.Request) -> None:
        if request.url.path == "/generate":
            bodies.append(json.loads(request.content))

    client = standin.client(**LAYOUT)
    client._transport.client = httpx.AsyncClient(event_hooks={"request": [record]})
    first = await client.generate(
        prompt, SamplingParams(max_new_tokens=4, temperature=0), return_routed_experts=True
    )
    held = len(prompt) + len(first.tokens) - 1  # the rows of inputs 0 .. held - 1 are in hand
    rest = await client.generate(
        prompt + list(first.tokens),
        SamplingParams(max_new_tokens=6, temperature=0),
        return_routed_experts=True,
        routed_experts_start_len=held,
    )
    assert "routed_experts_start_len" not in bodies[0] and bodies[1]["routed_experts_start_len"] == held
    assert first.tokens + rest.tokens == whole.tokens
    assert first.routed_experts is not None and rest.routed_experts is not None
    assert rest.routed_experts_start == held and rest.routed_experts.shape == (len(rest.tokens), 2, 2)
    assert whole.routed_experts is not None
    assert np.array_equal(np.concatenate([first.routed_experts, rest.routed_experts]), whole.routed_experts)
    with pytest.raises(ValueError, match=r"routed_experts_start_len must be an int in \[0, 4\]"):
        await client.generate(prompt, GREEDY, return_routed_experts=True, routed_experts_start_len=5)
    assert len(bodies) == 2  # refused before any request
    await client.aclose()
    async with httpx.AsyncClient(base_url=standin.url) as http:  # the server's own bounds, as SGLang's
        body: dict[str, object] = {"input_ids": prompt, "return_routed_experts": True}
        body["sampling_params"] = {"max_new_tokens": 3, "temperature": 0}
        at_end = (await http.post("/generate", json={**body, "routed_experts_start_len": 4})).json()
        raw = base64.b64decode(at_end["meta_info"]["routed_experts"])
        assert len(raw) == (len(at_end["output_ids"]) - 1) * 2 * 2 * 4  # prompt + 3 - 1 - 4 rows
        beyond = await http.post("/generate", json={**body, "routed_experts_start_len": 5})
        assert beyond.status_code == 400
        assert "is higher than the number of input tokens" in beyond.json()["error"]["message"]


async def test_abort_in_flight_returns_partial_tokens_and_routes(standin: StandIn) -> None:
    prompt = [3, 4, 5, 6]
    full = await reference(tiny_moe(), prompt, LONG)
    client = standin.client(**LAYOUT)
    may_decode, aborts = standin.hold_decoding_until_abort()
    task = asyncio.ensure_future(
        client.generate(prompt, LONG, request_id="rollout-7", return_routed_experts=True)
    )
    await standin.wait_for_tokens(3)
    may_decode.clear()  # from here the request can end only by the abort
    await client.abort("rollout-7")
    aborted = await task
    count = len(aborted.tokens)
    assert aborts == ["rollout-7"]
    assert aborted.finish_reason is FinishReason.ABORT and 3 <= count < 240
    assert aborted.tokens == full.tokens[:count]
    assert aborted.logprobs == pytest.approx(full.logprobs[:count], abs=1e-6)
    assert aborted.routed_experts is not None and full.routed_experts is not None
    assert aborted.routed_experts.shape == (len(prompt) + count - 1, 2, 2)
    assert np.array_equal(aborted.routed_experts, full.routed_experts[: len(prompt) + count - 1])
    await client.abort("no-such-request")  # SGLang answers 200 for an unknown rid
    # A caller that gives up (cancels) disconnects, and the server aborts the request. From the cancel
    # on, the engine may not decode until an abort reaches it: the request can end only by that abort.
    engine = standin.engine
    aborts.clear()
    task = asyncio.ensure_future(client.generate(prompt, LONG))
    await standin.wait_for_tokens(3)
    may_decode.clear()
    task.cancel()
    most = 0

    def gone() -> bool:
        nonlocal most
        rows = list(engine._rows)
        most = max([most, *(len(r.tokens) for r in rows)])
        return not rows

    await standin.wait_until(gone)
    # Ended by the disconnect, not by its length: through the server's abort, or, when the HTTP server
    # cancels the handler of a gone client before the server's check sees it, by that cancellation
    # (the engine drops a cancelled request's row without an abort: rare, and only on a loaded machine).
    assert len(aborts) <= 1 and most < 240
    await client.aclose()


async def test_weight_update_through_disk(standin: StandIn, tmp_path: Path) -> None:
    weights_dir = tmp_path / "published"
    client = standin.client(
        weights_dir=str(weights_dir), base_model_dir=str(standin.base), max_shard_bytes=60_000, **LAYOUT
    )
    new_weights = {k: v + 0.05 * torch.randn_like(v) for k, v in tiny_moe(seed=1).state_dict().items()}
    prompt = [3, 4, 5, 6]
    old_full = await reference(tiny_moe(), prompt, LONG)
    may_decode, aborts = standin.hold_decoding_until_abort()
    task = asyncio.ensure_future(client.generate(prompt, LONG, return_routed_experts=True))
    await standin.wait_for_tokens(3)
    may_decode.clear()  # however long the checkpoint takes to write, the request waits for the update
    await client.update_weights(new_weights, version=1)
    interrupted = await task
    count = len(interrupted.tokens)
    assert aborts  # the update's pause aborted it (SGLang repeats abort-all until no request runs)
    assert interrupted.finish_reason is FinishReason.ABORT and 3 <= count < 240  # resumable
    assert interrupted.tokens == old_full.tokens[:count] and interrupted.versions == (0,) * count
    assert client.version == 1 and standin.engine.version == 1
    checkpoint = weights_dir / "version-1"
    assert (checkpoint / "config.json").is_file() and (checkpoint / "model.safetensors.index.json").is_file()
    assert len(list(checkpoint.glob("model-*-of-*.safetensors"))) > 1
    for name, tensor in standin.model.state_dict().items():
        assert torch.equal(tensor, new_weights[name]), name

    # The driver resumes from the accumulated tokens: a new segment under the new version.
    resumed_prompt = prompt + list(interrupted.tokens)
    resumed = await client.generate(resumed_prompt, GREEDY)
    fresh = tiny_moe()
    fresh.load_state_dict(new_weights)
    assert list(resumed.tokens) == reference_greedy(fresh, resumed_prompt, len(resumed.tokens))
    assert resumed.versions == (1,) * len(resumed.tokens)

    await client.update_weights(tiny_moe(seed=2).state_dict(), version=2)
    assert sorted(p.name for p in weights_dir.iterdir()) == ["version-2"]  # the older one is pruned
    with pytest.raises(ValueError, match="must exceed the current 2"):
        await client.update_weights(new_weights, version=2)
    broken = {"model.embed_tokens.weight": torch.zeros(3, 3)}
    with pytest.raises(SGLangRequestError, match="does not match"):
        await client.update_weights(broken, version=3)
    assert client.version == 2 and standin.engine.version == 2
    after = await client.generate(prompt, GREEDY)  # not left paused by the failed update
    assert after.finish_reason is FinishReason.LENGTH and after.versions == (2,) * len(after.tokens)
    info = await client.model_info()
    assert info["weight_version"] == "2" and info["model_path"] == str(weights_dir / "version-2")
    await client.aclose()


@pytest.mark.slow
async def test_published_weights_take_the_checkpoint_layout(standin: StandIn, tmp_path: Path) -> None:
    """What a real server loads: names as `save_pretrained` writes them (one tensor per expert), not
    transformers' fused in-memory experts, which SGLang would skip, leaving its experts stale."""
    saved = tmp_path / "saved"
    standin.model.save_pretrained(saved)
    on_disk = set(read_safetensors(saved))
    new_weights = {k: v + 0.05 * torch.randn_like(v) for k, v in tiny_moe(seed=1).state_dict().items()}
    assert on_disk != set(new_weights)  # the two layouts differ for this model: the renaming matters
    weights_dir = tmp_path / "published"
    options = SGLangOptions(
        url=standin.url, weights_dir=str(weights_dir), base_model_dir=str(standin.base), **LAYOUT
    )  # type: ignore[arg-type]
    client = SGLangEngine(options, layout=layout_of(type(standin.model), standin.model.config))
    await client.update_weights(new_weights, version=1)
    assert set(read_safetensors(weights_dir / "version-1")) == on_disk
    for name, tensor in standin.model.state_dict().items():  # loaded through the checkpoint layout, exactly
        assert torch.equal(tensor, new_weights[name]), name
    await client.aclose()


async def test_health_and_a_dead_server(standin: StandIn) -> None:
    client = standin.client()
    assert await client.health()
    await client.aclose()
    dead = SGLangEngine(SGLangOptions(url=f"http://127.0.0.1:{free_port()}", retries=2, backoff_s=0.2))
    assert not await dead.health()
    with pytest.raises(SGLangUnavailable, match=r"127\.0\.0\.1:\d+/generate.*gave up after 3 attempts"):
        await dead.generate([1, 2, 3], GREEDY)
    with pytest.raises(SGLangUnavailable, match="abort_request"):
        await dead.abort("x")
    await dead.aclose()
    await dead.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await dead.generate([1], GREEDY)


async def test_invalid_input_fails_before_any_request(tmp_path: Path) -> None:
    # Nothing listens there: a request would end in SGLangUnavailable, not in these ValueErrors.
    client = SGLangEngine(SGLangOptions(url=f"http://127.0.0.1:{free_port()}", retries=0))
    sent: list[httpx.Request] = []

    async def record(request: httpx.Request) -> None:
        sent.append(request)

    client._transport.client = httpx.AsyncClient(event_hooks={"request": [record]})
    cases: list[tuple[object, str]] = [
        (client.generate([], GREEDY), "input_ids is empty"),
        (client.generate([1, -2], GREEDY), "non-negative ints"),
        (client.generate([1], SamplingParams(stop_strings=("x",) * 33)), "at most 32 stop strings"),
        (client.generate([1], SamplingParams(temperature=0.7, top_p=0.9)), "before top-k/top-p truncation"),
        (client.generate([1], SamplingParams(temperature=1.0, top_k=20)), "allow_untruncated_logprobs"),
        (client.generate([1], GREEDY, request_id=""), "request_id must be a non-empty string"),
        (client.abort(""), "request_id must be a non-empty string"),
        (client.update_weights({"w": torch.zeros(1)}, version=0), "must exceed the current 0"),
        (client.update_weights({"w": torch.zeros(1)}, version=1), "weights_dir must be set"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            await call  # type: ignore[misc]
    assert sent == []  # every one refused before any request
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0.0)
    for bad in ({"url": "ftp://host"}, {"retries": -1}, {"connect_timeout_s": 0}, {"num_layers": 0}):
        with pytest.raises(ValueError, match="SGLangOptions"):
            SGLangOptions(**bad)
    allowed = SGLangEngine(SGLangOptions(url=client.options.url, retries=0, allow_untruncated_logprobs=True))
    with pytest.raises(SGLangUnavailable):  # accepted locally, so it reaches for the (dead) server
        await allowed.generate([1], SamplingParams(temperature=0.7, top_p=0.9))
    await client.aclose()
    await allowed.aclose()


async def test_standin_answers_and_refuses_as_sglang(standin: StandIn, tmp_path: Path) -> None:
    async with httpx.AsyncClient(base_url=standin.url) as http:
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        answer = (await http.post("/generate", json={**body, "return_logprob": True, "rid": "r"})).json()
        meta = answer["meta_info"]
        assert "text" not in answer  # no tokenizer: SGLang's skip_tokenizer_init answer
        assert (
            len(answer["output_ids"]) == 4 and meta["completion_tokens"] == 4 and meta["prompt_tokens"] == 3
        )
        assert meta["id"] == "r" and meta["weight_version"] == "0"
        assert meta["finish_reason"] == {"type": "length", "length": 4}
        assert [entry[1:] for entry in meta["output_token_logprobs"]] == [
            [t, None] for t in answer["output_ids"]
        ]
        assert meta["input_token_logprobs"] == [] and "routed_experts" not in meta

        async def refusal(path: str, payload: object) -> object:
            response = await http.post(path, json=payload)
            assert response.status_code == 400, response.text
            return response.json()

        unknown = await refusal("/generate", {**body, "sampling_params": {"foo": 1}})
        assert unknown["error"].startswith("unknown field `foo`, expected one of `max_new_tokens`")  # type: ignore[index]
        typed = await refusal("/generate", {**body, "sampling_params": {"temperature": "hot"}})
        assert typed == {"error": 'invalid type: string "hot", expected f64'}
        top_k = await refusal("/generate", {**body, "sampling_params": {"top_k": 0}})
        assert top_k == {"error": {"message": "top_k must be -1 (disable) or at least 1, got 0."}}
        neither = await refusal("/generate", {"sampling_params": {}})
        assert neither == {"error": {"message": "Either text, input_ids or input_embeds should be provided."}}
        vocab = await refusal("/generate", {"input_ids": [300]})
        assert "out of vocabulary" in vocab["error"]["message"]  # type: ignore[index]
        malformed = await http.post(
            "/generate", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert malformed.status_code == 400
        assert malformed.json()["object"] == "error" and malformed.json()["code"] == 400
        missing = await refusal("/update_weights_from_disk", {"model_path": str(tmp_path / "nowhere")})
        assert missing["success"] is False and "is not a directory" in missing["message"]  # type: ignore[index]
        await refusal("/pause_generation", {"mode": "in_place"})
        ignored = await http.post("/abort_request", json={})  # an empty rid without abort_all
        assert ignored.status_code == 200 and ignored.content == b""

    client = standin.client(**LAYOUT)
    with pytest.raises(ContextOverflowError, match="longer than the model's context length"):
        await client.generate([2] * 300, GREEDY)
    await client.aclose()


async def test_routes_asked_of_a_server_without_the_flag(tmp_path: Path) -> None:
    standin = StandIn(tmp_path, routed_experts=False)
    with standin.server:
        client = standin.client(**LAYOUT)
        with pytest.raises(SGLangProtocolError, match="--enable-return-routed-experts"):
            await client.generate([4, 5], GREEDY, return_routed_experts=True)
        await client.aclose()


def test_token_versions_follow_the_server() -> None:
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert token_versions({"weight_versions": spans, "weight_version": "4"}, 5, 0, "u") == (3, 3, 4, 4, 4)
    assert token_versions({"weight_version": "7"}, 2, 0, "u") == (7, 7)
    assert token_versions({"weight_version": "default"}, 3, 5, "u") == (5, 5, 5)  # not an int: the client's
    with pytest.raises(SGLangProtocolError, match="cover 5 of 6"):
        token_versions({"weight_versions": spans}, 6, 0, "u")


class _ExecCalledError(Exception):
    def __init__(self, path: str, argv: list[str]) -> None:
        super().__init__(path)
        self.path, self.argv = path, argv


def test_serve_sglang_builds_the_launch_argv(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert launch_command("Qwen/Qwen3-30B-A3B", 30001, "/envs/sglang/bin/python", ["--tp", "2"]) == [
        "/envs/sglang/bin/python", "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen3-30B-A3B",
        "--port", "30001", "--host", "127.0.0.1", "--enable-return-routed-experts", "--weight-version", "0",
        "--tp", "2",
    ]  # fmt: skip
    dense = launch_command("m", 1, "py", [], moe=False, weight_version=None)
    assert dense == [
        "py",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "m",
        "--port",
        "1",
        "--host",
        "127.0.0.1",
    ]
    with pytest.raises(ValueError, match="port"):
        launch_command("m", 70000, "py", [])

    def fake_execv(path: str, argv: list[str]) -> None:
        raise _ExecCalledError(path, argv)

    monkeypatch.setattr(os, "execv", fake_execv)
    with pytest.raises(_ExecCalledError) as execed:
        main(["serve", "sglang", "--model", "/ckpt", "--port", "31000", "--weight-version", "5", "--",
              "--mem-fraction-static", "0.8"])  # fmt: skip
    assert execed.value.path == sys.executable
    assert execed.value.argv == [
        sys.executable, "-m", "sglang.launch_server", "--model-path", "/ckpt", "--port", "31000",
        "--host", "127.0.0.1", "--enable-return-routed-experts", "--weight-version", "5",
        "--mem-fraction-static", "0.8",
    ]  # fmt: skip
    with pytest.raises(_ExecCalledError) as execed:
        main(["serve", "sglang", "--model", "/ckpt", "--no-moe", "--python", "python3"])
    assert "--enable-return-routed-experts" not in execed.value.argv and execed.value.argv[0] == "python3"
    assert main(["serve", "sglang", "--model", "/ckpt", "--python", "/no/such/python"]) == 2
    assert "is not an executable" in capsys.readouterr().err


@pytest.mark.gpu
async def test_against_a_real_sglang_server() -> None:
    """Runs with `pytest -m gpu` and PACERL_SGLANG_URL pointing at `pacerl serve sglang --model DIR`
    on this machine (a MoE model; PACERL_SGLANG_MOE=0 for a dense one). It reloads DIR as a new
    weight version."""
    url = os.environ.get("PACERL_SGLANG_URL")
    if not url:
        pytest.skip(
            "NOT TESTED AGAINST REAL SGLANG: set PACERL_SGLANG_URL to a running `pacerl serve sglang` "
            "server to run this test"
        )
    moe = os.environ.get("PACERL_SGLANG_MOE", "1") != "0"
    probe = SGLangEngine(SGLangOptions(url=url))
    assert await probe.health()
    info = await probe.model_info()
    await probe.aclose()
    assert str(info["weight_version"]).isdecimal(), "launch it with an integer --weight-version"
    local = await asyncio.to_thread(Path(info["model_path"], "config.json").is_file)
    assert local, "its --model-path must be a local directory"
    start = int(info["weight_version"])
    client = SGLangEngine(SGLangOptions(url=url), version=start)
    prompt = [1, 2, 3, 4, 5]
    greedy = SamplingParams(max_new_tokens=16, temperature=0)
    done = await client.generate(prompt, greedy, return_routed_experts=moe)
    assert done.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and 1 <= len(done.tokens) <= 16
    assert all(lp <= 0 for lp in done.logprobs) and done.versions == (start,) * len(done.tokens)
    if moe:
        assert done.routed_experts is not None
        assert done.routed_experts.shape[0] == len(prompt) + len(done.tokens) - 1
    long = SamplingParams(max_new_tokens=4000, temperature=0, ignore_eos=True)
    task = asyncio.ensure_future(client.generate(prompt, long, request_id="pacerl-gpu-abort"))
    await asyncio.sleep(1.0)
    await client.abort("pacerl-gpu-abort")
    aborted = await task
    assert aborted.finish_reason is FinishReason.ABORT and len(aborted.tokens) < 4000
    # Reload the server's own checkpoint as the next version, with a request in flight.
    task = asyncio.ensure_future(client.generate(prompt, long))
    await asyncio.sleep(1.0)
    await client.update_weights(str(info["model_path"]), version=start + 1)
    interrupted = await task
    assert interrupted.finish_reason is FinishReason.ABORT
    assert interrupted.versions == (start,) * len(interrupted.tokens)
    after = await client.generate(prompt, SamplingParams(max_new_tokens=4, temperature=0))
    assert after.versions == (start + 1,) * len(after.tokens) and client.version == start + 1
    await client.aclose()
