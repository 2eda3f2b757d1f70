"""SGLang's distributed weight path: the client forms a torch.distributed group with the stand-in (gloo
on CPU) and publishes by broadcast. The stand-in ends up with exactly the trainer's tensors; names and
shapes that do not fit are refused with the server's message and leave the old weights; a server that
dies mid-broadcast is a clear `SGLangUnavailable`, not a hang; `pacerl train` publishes through the
group; and the trainer's side of the group is formed beside a default process group without touching
it, across two processes."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from pacerl.agents.engine.embedded import EmbeddedEngine
from pacerl.agents.engine.protocol import FinishReason, SamplingParams
from pacerl.agents.engine.sglang import SGLangEngine, SGLangOptions
from pacerl.agents.engine.sglang_protocol import SGLangRequestError, SGLangUnavailable
from pacerl.agents.engine.weight_group import WeightBroadcastGroup, describe
from pacerl.agents.models import load_model
from pacerl.config import config_from_dict
from pacerl.train import train
from pacerl.trainer.metrics import read_metrics
from tests import sglang_standin
from tests.agents.helpers import LAYOUT, StandIn, reference_greedy, tiny_moe
from tests.helpers import ThreadServer, free_port, small_run
from tests.sglang_standin import create_standin_app

GREEDY = SamplingParams(max_new_tokens=8, temperature=0)
DISTRIBUTED: dict[str, Any] = {"weight_transport": "distributed", "weight_group_timeout_s": 60.0, **LAYOUT}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[StandIn]:
    server = StandIn(tmp_path)
    with server.server:
        yield server


def record(client: SGLangEngine) -> list[tuple[str, Any]]:
    """(path, JSON body or None) of every request `client` sends from now on."""
    sent: list[tuple[str, Any]] = []

    async def hook(request: httpx.Request) -> None:
        sent.append((request.url.path, json.loads(request.content) if request.content else None))

    client._transport.client = httpx.AsyncClient(event_hooks={"request": [hook]})
    return sent


def perturbed(seed: int) -> dict[str, torch.Tensor]:
    return {k: v + 0.05 * torch.randn_like(v) for k, v in tiny_moe(seed=seed).state_dict().items()}


async def test_a_publication_gives_the_server_exactly_the_trainers_weights(standin: StandIn) -> None:
    client = standin.client(**DISTRIBUTED)
    sent = record(client)
    new_weights = perturbed(1)
    await client.update_weights(new_weights, version=1)  # the Engine protocol's call, by broadcast
    for name, tensor in standin.model.state_dict().items():
        assert torch.equal(tensor, new_weights[name]), name
    assert client.version == 1 and standin.engine.version == 1
    prompt = [3, 4, 5, 6]
    after = await client.generate(prompt, GREEDY)
    fresh = tiny_moe()
    fresh.load_state_dict(new_weights)
    assert list(after.tokens) == reference_greedy(fresh, prompt, len(after.tokens))
    assert after.versions == (1,) * len(after.tokens)

    # A second publication reuses the group; a bfloat16 subset is cast into the float32 model, as
    # SGLang's loaders do, and the other tensors stay.
    names = ["model.embed_tokens.weight", "lm_head.weight"]
    subset = {name: (2 * new_weights[name]).to(torch.bfloat16) for name in names}
    await client.update_weights_distributed(subset, version=2)
    own = standin.model.state_dict()
    for name in names:
        assert torch.equal(own[name], subset[name].to(torch.float32)), name
    assert torch.equal(own["model.norm.weight"], new_weights["model.norm.weight"])
    assert (await client.model_info())["weight_version"] == "2"

    paths = [path for path, _ in sent]
    assert paths.count("/init_weights_update_group") == 1 and "/update_weights_from_disk" not in paths
    updates = [i for i, path in enumerate(paths) if path == "/update_weights_from_distributed"]
    assert len(updates) == 2
    for i in updates:  # paused as the disk path is, inside the weight-update session SGLang requires
        assert paths[i - 2 : i] == ["/pause_generation", "/begin_weight_update"]
        assert paths[i + 1 : i + 3] == ["/end_weight_update", "/continue_generation"]
    init = next(body for path, body in sent if path == "/init_weights_update_group")
    assert init["rank_offset"] == 1 and init["world_size"] == 2 and init["backend"] == "gloo"
    assert init["master_address"] == "127.0.0.1" and init["group_name"].startswith("pacerl-weights-")
    first, second = (sent[i][1] for i in updates)
    assert first["names"] == list(new_weights) and set(first["dtypes"]) == {"float32"}
    assert first["shapes"] == [list(t.shape) for t in new_weights.values()]
    assert first["group_name"] == init["group_name"] and first["weight_version"] == "1"
    assert first["flush_cache"] is True and first["abort_all_requests"] is False
    assert second["names"] == names and second["dtypes"] == ["bfloat16", "bfloat16"]

    await client.aclose()  # leaves the group: the server destroys its side
    async with httpx.AsyncClient(base_url=standin.url) as http:
        gone = await http.post("/destroy_weights_update_group", json={"group_name": init["group_name"]})
    assert gone.status_code == 400 and gone.json()["message"] == "The group to be destroyed does not exist."


async def test_weights_that_do_not_fit_are_refused_clearly_and_leave_the_old_ones(standin: StandIn) -> None:
    client = standin.client(**DISTRIBUTED)
    sent = record(client)
    original = tiny_moe().state_dict()
    good = perturbed(1)
    unknown = {**good, "model.nope.weight": torch.zeros(2)}
    with pytest.raises(
        SGLangRequestError, match=r"refused the weight broadcast: .*unknown parameter 'model\.nope"
    ):
        await client.update_weights_distributed(unknown, version=1)
    reshaped = {"lm_head.weight": torch.zeros(3, 3)}
    with pytest.raises(
        SGLangRequestError, match=r"lm_head\.weight: shape \(3, 3\) does not match \(300, 64\)"
    ):
        await client.update_weights_distributed(reshaped, version=1)
    for name, tensor in standin.model.state_dict().items():  # checked before any copy: untouched
        assert torch.equal(tensor, original[name]), name
    assert client.version == 0 and standin.engine.version == 0
    after = await client.generate([4, 5], GREEDY)  # not left paused
    assert after.finish_reason is FinishReason.LENGTH and after.versions == (0,) * len(after.tokens)

    # Refused before any request: what the broadcast cannot carry, or not a full tensor at all.
    count = len(sent)
    cases: list[tuple[Any, str]] = [
        ({"w": torch.zeros(2, dtype=torch.int16)}, "dtype int16 cannot be broadcast"),
        ({"w": [1.0, 2.0]}, "expected a torch.Tensor, got list"),
        ({}, "non-empty mapping"),
    ]
    for weights, message in cases:
        with pytest.raises(ValueError, match=message):
            await client.update_weights_distributed(weights, version=1)
    with pytest.raises(ValueError, match="must exceed the current 0"):
        await client.update_weights_distributed(good, version=0)
    assert len(sent) == count

    # The server's own refusals, before it receives anything: an update outside a weight-update
    # session (sglang 0.5.23), a dtype torch does not name (SGLang resolves them with getattr(torch,
    # name), so "torch.float32" is none), a group never formed.
    group = next(body for path, body in sent if path == "/init_weights_update_group")["group_name"]
    announce: dict[str, Any] = {"names": ["lm_head.weight"], "shapes": [[300, 64]], "group_name": group}
    async with httpx.AsyncClient(base_url=standin.url) as http:

        async def refusal(body: dict[str, Any]) -> str:
            response = await http.post("/update_weights_from_distributed", json=body)
            assert response.status_code == 400 and response.json()["success"] is False
            return str(response.json()["message"])

        outside = await refusal({**announce, "dtypes": ["float32"]})
        assert outside.startswith("update_weights_from_distributed must run between begin_weight_update()")
        assert (await http.post("/begin_weight_update", json={})).json()["success"] is True
        assert "has no attribute 'torch.float32'" in await refusal({**announce, "dtypes": ["torch.float32"]})
        stray = {**announce, "dtypes": ["float32"], "group_name": "no-such-group"}
        assert "call `init_weights_update_group` first" in await refusal(stray)
        assert (await http.post("/end_weight_update", json={})).json()["success"] is True

    # The group is still in step after the refusals: the next publication goes through it.
    await client.update_weights_distributed(good, version=1)
    for name, tensor in standin.model.state_dict().items():
        assert torch.equal(tensor, good[name]), name
    assert [path for path, _ in sent].count("/init_weights_update_group") == 1
    await client.aclose()
    for bad in ({"weight_transport": "tcp"}, {"weight_group_port": 70000}, {"weight_group_ranks": 0}):
        with pytest.raises(ValueError, match="SGLangOptions"):
            SGLangOptions(**bad)


@pytest.mark.timeout(120)  # well under the group's timeout: the refusal must not wait for it
async def test_a_server_that_cannot_join_is_a_refusal_at_once(
    standin: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    def cannot_join(*args: object) -> None:
        raise RuntimeError("no route to the trainer's store")

    monkeypatch.setattr(sglang_standin, "join_weight_group", cannot_join)
    # This side's join never completes now; only its timeout would end it.
    client = standin.client(**{**DISTRIBUTED, "weight_group_timeout_s": 600.0})
    refused = r"refused forming the weight group: Failed to initialize custom process group: no route"
    with pytest.raises(SGLangRequestError, match=refused):
        await client.update_weights_distributed(perturbed(1), version=1)
    assert client.version == 0 and standin.engine.version == 0
    after = await client.generate([4, 5], GREEDY)  # the server was never paused
    assert after.finish_reason is FinishReason.LENGTH
    await client.aclose()


_DYING_SERVER = """
import os, sys
import torch.distributed as dist
import uvicorn
from pacerl.agents.engine.embedded import EmbeddedEngine
from tests.agents.helpers import tiny_moe
from tests.sglang_standin import create_standin_app

broadcast, posted = dist.broadcast, []

def dying_broadcast(tensor, src, group=None, async_op=False):
    # Dies once the first tensor is in, while rank 0 still has the others to send.
    if posted:
        posted[0].wait()
        os._exit(17)
    posted.append(broadcast(tensor, src, group=group, async_op=async_op))
    return posted[0]

dist.broadcast = dying_broadcast
app = create_standin_app(EmbeddedEngine(tiny_moe()), weight_version="0", weight_group_timeout_s=60)
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


@pytest.mark.slow
async def test_a_server_that_dies_mid_broadcast_is_a_clear_error_not_a_hang() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = await asyncio.create_subprocess_exec(sys.executable, "-c", _DYING_SERVER, str(port), cwd=REPO)
    try:
        await _wait_until_up(url, server)
        client = SGLangEngine(
            SGLangOptions(url=url, retries=0, **{**DISTRIBUTED, "weight_group_timeout_s": 30})
        )
        with pytest.raises(SGLangUnavailable, match=url):
            await client.update_weights_distributed(perturbed(1), version=1)
        assert await asyncio.wait_for(server.wait(), 60) == 17  # it died where the test made it die
        assert client.version == 0
        await client.aclose()
    finally:
        if server.returncode is None:
            server.kill()
            await server.wait()


async def _wait_until_up(url: str, server: asyncio.subprocess.Process) -> None:
    deadline = time.monotonic() + 120  # a hang guard: the stand-in starts in seconds
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            if server.returncode is not None:
                raise RuntimeError(f"the stand-in exited with {server.returncode} before it served")
            try:
                if (await http.get(url + "/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"the stand-in did not come up on {url}")


@pytest.mark.slow
def test_pacerl_train_publishes_through_the_group(warm_model: tuple[Path, Path], tmp_path: Path) -> None:
    """`pacerl train` with `sglang.weight_transport=distributed`: every publication is a broadcast
    into the stand-in, nothing is written to disk, routes still come back for R3."""
    model, tokenizer = load_model(warm_model[0])
    server_engine = EmbeddedEngine(model, tokenizer)
    app = create_standin_app(server_engine, model_path=str(warm_model[0]), weight_version="0")
    with ThreadServer(app) as server:
        sglang = {"url": server.url, "weight_transport": "distributed", "weight_group_timeout_s": 60}
        settings = small_run(
            warm_model,
            tmp_path / "run",
            engine_backend="sglang",
            sglang=sglang,
            loop={"steps": 4, "mode": "async", "sync_interval": 2},
        )
        summary = asyncio.run(train(config_from_dict(settings)))
        served_version = server_engine.version
    assert summary["step"] == 4 and summary["version"] >= 2
    assert served_version == summary["version"] - summary["version"] % 2  # published every 2 updates
    weights = tmp_path / "run" / "weights"
    assert not weights.exists() or not any(weights.iterdir())  # nothing went through disk
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    updated = [row for row in rows if row["updated"]]
    assert updated and all(row["r3_coverage"] == 1.0 for row in updated)


# -- two processes: the trainer's rank 0 beside its default group, and a server rank ----------------


def trainer_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return {
        "layer.weight": torch.randn(64, 32, generator=generator),
        "layer.bias": torch.randn(32, generator=generator).to(torch.bfloat16),
        "steps": torch.arange(5),
    }


def _trainer(ports: Any, report: str) -> None:
    import torch.distributed as dist

    # The trainer's own default group (its FSDP ranks); the weight group must leave it alone.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    world = dist.group.WORLD
    group = WeightBroadcastGroup(
        address="127.0.0.1", port=0, world_size=2, group_name="trainer-weights", backend="gloo", timeout_s=60
    )
    ports.put(group.port)
    group.connect()
    group.broadcast(list(trainer_tensors().items()))
    total = torch.ones(1)
    dist.all_reduce(total)
    Path(report).write_text(
        json.dumps(
            {
                "default_unchanged": dist.group.WORLD is world,
                "default_world_size": dist.get_world_size(),
                "groups_torch_knows": len(dist.distributed_c10d._world.pg_map),
                "all_reduce": total.item(),
            }
        )
    )
    group.close()
    dist.destroy_process_group()


def _server_rank(port: int, received: str) -> None:
    import torch.distributed as dist

    from tests.sglang_standin import join_weight_group, receive_weights

    # An SGLang worker has its own default group (its tensor-parallel one) when it joins.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    group = join_weight_group("127.0.0.1", port, 1, 2, "trainer-weights", 60)
    manifest = describe(trainer_tensors())
    tensors = receive_weights(
        group, list(manifest.names), list(manifest.dtypes), [list(s) for s in manifest.shapes]
    )
    torch.save(dict(tensors), received)
    dist.destroy_process_group()


@pytest.mark.slow
def test_the_weight_group_forms_beside_a_default_group_across_two_processes(tmp_path: Path) -> None:
    spawn = multiprocessing.get_context("spawn")
    ports = spawn.Queue()
    report, received = tmp_path / "report.json", tmp_path / "received.pt"
    trainer = spawn.Process(target=_trainer, args=(ports, str(report)))
    trainer.start()
    try:
        port = ports.get(timeout=120)  # a hang guard
        server = spawn.Process(target=_server_rank, args=(port, str(received)))
        server.start()
        server.join(120)
        trainer.join(120)
        assert server.exitcode == 0 and trainer.exitcode == 0
    finally:
        for process in (trainer, locals().get("server")):
            if process is not None and process.is_alive():
                process.kill()
    got = torch.load(received)
    expected = trainer_tensors()
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert json.loads(report.read_text()) == {
        "default_unchanged": True,
        "default_world_size": 1,
        "groups_torch_knows": 1,  # the default group alone: the weight group is not in torch's world
        "all_reduce": 1.0,
    }
