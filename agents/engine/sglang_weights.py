"""How the SGLang engine (`pacerl.agents.engine.sglang`) gets new weights into its server.

Through disk by default: a state_dict is written as safetensors (plus the base model's config files)
into `SGLangOptions.weights_dir` (`write_checkpoint`), then generation is paused with mode "abort"
(`pause`; on a server without `/pause_generation`, every request is aborted by the update itself), the
server loads the directory (`load_from_disk`), and generation continues (`resume`). Each in-flight
request comes back `FinishReason.ABORT` with the tokens it had; the rollout driver resumes it from
those tokens as a new segment under the new version.

With `weight_transport="distributed"` the tensors go by torch.distributed broadcast instead (SGLang's
path for GPU clusters; `pacerl.agents.engine.weight_group` cites the server's side; `WeightGroupLink`): once,
this client hosts a rendezvous store, asks the server to join a group through it (`POST
/init_weights_update_group`, the server's tensor-parallel workers taking ranks 1..tp_size) and forms
the group as rank 0; then each publication pauses generation as above, opens a weight-update session
(`POST /begin_weight_update`, which sglang 0.5.23 requires around distributed updates), announces
names, dtypes and shapes (`POST /update_weights_from_distributed`) while broadcasting the tensors in
that order, closes the session (`POST /end_weight_update`) and continues.
The group is never torch.distributed's default one. A publication whose broadcast broke off (a dead
server, a timeout) discards the group; the next publication forms a new one under a new name.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import shutil
import socket
import tempfile
import threading
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import httpx
import torch

from pacerl.agents.engine.sglang_protocol import (
    SGLangError,
    SGLangProtocolError,
    SGLangRequestError,
    SGLangUnavailable,
    Transport,
    positive_int,
)
from pacerl.agents.engine.weight_group import GroupBackend, WeightBroadcastGroup, WeightManifest

_T = TypeVar("_T")
_log = logging.getLogger(__name__)

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
_CHECKPOINT = re.compile(r"version-(\d+)")


# -- pausing the server --------------------------------------------------------------------------------


async def pause(transport: Transport, timeout_s: float) -> bool:
    """Pause with mode "abort"; False on a server without `/pause_generation` (nothing paused)."""
    response = await transport.request(
        "POST", "/pause_generation", {"mode": "abort"}, timeout_s, repeatable=True
    )
    if response.status_code == 404:
        return False
    if response.status_code != 200:
        raise transport.refused("/pause_generation", response)
    return True


async def resume(transport: Transport, timeout_s: float) -> None:
    """Continue generation after `pause`."""
    response = await transport.request("POST", "/continue_generation", {}, timeout_s, repeatable=True)
    if response.status_code != 200:
        raise transport.refused("/continue_generation", response)


# -- through disk --------------------------------------------------------------------------------------


async def load_from_disk(
    transport: Transport, path: str, version: int, *, abort_all: bool, timeout_s: float
) -> None:
    """Have the server load the checkpoint at `path` (a path of the server's) as `version`."""
    body = {"model_path": path, "weight_version": str(version), "abort_all_requests": abort_all}
    route = "/update_weights_from_disk"
    response = await transport.request("POST", route, body, timeout_s, repeatable=False)
    loaded, message = transport.outcome(route, response)
    if not loaded:
        raise SGLangRequestError(
            f"the SGLang server at {transport.base} did not load the weights from {path}: {message}",
            response.status_code,
        )


def write_checkpoint(
    state_dict: Mapping[str, torch.Tensor],
    version: int,
    *,
    weights_dir: str | None,
    base_model_dir: str | None,
    max_shard_bytes: int,
) -> str:
    """`state_dict` as a safetensors checkpoint in `weights_dir/version-N` (with `base_model_dir`'s
    non-weight files, when given); the path."""
    if weights_dir is None:
        raise ValueError(
            "SGLangOptions.weights_dir must be set to publish a state_dict (SGLang loads weights from disk)"
        )
    if not state_dict:
        raise ValueError("the state_dict is empty")
    root = Path(weights_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"version-{version}"
    scratch = Path(tempfile.mkdtemp(prefix=f".version-{version}-", dir=root))
    try:
        if base_model_dir is not None:
            _copy_config_files(Path(base_model_dir), scratch)
        save_sharded(state_dict, scratch, max_shard_bytes)
        if final.exists():
            shutil.rmtree(final)  # left by an update the server did not take
        scratch.rename(final)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return str(final)


def prune(weights_dir: str | None, current: int, keep: int) -> None:
    """Delete older version directories beyond the newest `keep` (never the loaded one, `current`)."""
    if weights_dir is None:
        return
    root = Path(weights_dir).resolve()
    versions = sorted(
        (int(match[1]), path)
        for path in root.iterdir()
        if (match := _CHECKPOINT.fullmatch(path.name)) and path.is_dir() and int(match[1]) <= current
    )
    for _, path in versions[:-keep]:
        shutil.rmtree(path)


def save_sharded(state_dict: Mapping[str, torch.Tensor], directory: Path, max_shard_bytes: int) -> None:
    """Write `state_dict` as `model.safetensors`, or as shards of at most `max_shard_bytes` (a single
    bigger tensor gets its own shard) with the `model.safetensors.index.json` transformers writes."""
    from safetensors.torch import save_file

    shards: list[list[str]] = [[]]
    used = 0
    total = 0
    for name, tensor in state_dict.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise ValueError(f"state_dict entries must be str -> torch.Tensor, got {name!r}")
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
        total += size
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for file_name, shard in zip(names, shards, strict=True):
        tensors = {}
        for name in shard:
            tensor = state_dict[name].detach().to("cpu")
            # safetensors refuses tensors that share memory (tied weights, views): give each its own.
            tensors[name] = tensor.clone(memory_format=torch.contiguous_format)
        save_file(tensors, str(directory / file_name), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {name: file for file, shard in zip(names, shards, strict=True) for name in shard},
        }
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _copy_config_files(source: Path, target: Path) -> None:
    if not source.is_dir():
        raise ValueError(f"SGLangOptions.base_model_dir {str(source)!r} is not a directory")
    for path in source.iterdir():
        if (
            path.is_file()
            and not path.name.endswith(_WEIGHT_SUFFIXES)
            and not path.name.endswith(".index.json")
        ):
            shutil.copy2(path, target / path.name)


# -- by broadcast --------------------------------------------------------------------------------------


class WeightGroupLink:
    """The weight group this client shares with one server, formed on first use (`joined`), and the
    broadcasts through it (`send`). The `SGLangOptions.weight_group_*` fields, the timeouts of
    updates and of control calls, and the transport to the server are all it needs."""

    def __init__(
        self,
        transport: Transport,
        *,
        ranks: int | None,
        address: str | None,
        port: int,
        backend: GroupBackend | None,
        timeout_s: float,
        update_timeout_s: float,
        control_timeout_s: float,
    ) -> None:
        self._transport = transport
        self._ranks = ranks
        self._address = address
        self._port = port
        self._backend = backend
        self._timeout_s = timeout_s
        self._update_timeout_s = update_timeout_s
        self._control_timeout_s = control_timeout_s
        self._group: WeightBroadcastGroup | None = None

    async def joined(self) -> WeightBroadcastGroup:
        """The weight group, formed with the server on first use: this process hosts the rendezvous
        store and joins as rank 0 while the server, asked by `/init_weights_update_group`, joins
        through the same store."""
        if self._group is not None:
            return self._group
        ranks = self._ranks or await self._server_ranks()
        address = self._address
        if address is None:
            address = await asyncio.to_thread(_local_address, self._transport.base)
        backend: GroupBackend = self._backend or ("nccl" if torch.cuda.is_available() else "gloo")
        # A fresh name each time: a server keeps a broken group's name registered until it is destroyed.
        name = f"pacerl-weights-{uuid.uuid4().hex[:12]}"
        try:
            group = WeightBroadcastGroup(
                address=address,
                port=self._port,
                world_size=ranks + 1,
                group_name=name,
                backend=backend,
                timeout_s=self._timeout_s,
            )
        except RuntimeError as error:  # torch's DistNetworkError and DistStoreError are RuntimeErrors
            raise SGLangError(
                f"cannot host the weight group's rendezvous store on {address}:{self._port} "
                f"(SGLangOptions.weight_group_address / weight_group_port): {error}"
            ) from None
        body = {
            "master_address": address,
            "master_port": group.port,
            "rank_offset": 1,
            "world_size": ranks + 1,
            "group_name": name,
            "backend": backend,
        }
        joined = _in_thread(group.connect)
        try:
            await self._alongside(
                "/init_weights_update_group",
                body,
                self._timeout_s,
                joined,
                "forming the weight group",
                settle_on_refusal=False,  # a server that did not join leaves this side waiting in vain
            )
        except BaseException:
            _discard(group, joined)
            raise
        self._group = group
        return group

    async def send(
        self,
        group: WeightBroadcastGroup,
        manifest: WeightManifest,
        weights: Mapping[str, torch.Tensor],
        version: int,
        *,
        abort_all: bool,
    ) -> None:
        """Load `weights` (described by `manifest`) into the server as `version` through `group`,
        inside a weight-update session when the server has them."""
        body = {
            "names": list(manifest.names),
            "dtypes": list(manifest.dtypes),
            "shapes": [list(shape) for shape in manifest.shapes],
            "group_name": group.group_name,
            "flush_cache": True,  # cached prefixes hold KV of the old weights
            "weight_version": str(version),
            "abort_all_requests": abort_all,
        }
        # SGLang 0.5.23 takes distributed updates only inside a weight-update session.
        session = await self._session_call("/begin_weight_update", {"selector": "all"})
        try:
            await self._broadcast_load(group, body, weights)
        except BaseException as error:
            if session:
                try:
                    await self._session_call("/end_weight_update", {})
                except SGLangError as also:
                    error.add_note(f"and the weight-update session could not be closed: {also}")
            raise
        if session:
            await self._session_call("/end_weight_update", {})

    async def leave(self) -> None:
        """Ask the server to destroy its side of the group (a failure to is logged: the server may be
        gone) and close this side. Nothing without a group."""
        if self._group is None:
            return
        group, self._group = self._group, None
        route = "/destroy_weights_update_group"
        try:
            response = await self._transport.request(
                "POST", route, {"group_name": group.group_name}, self._control_timeout_s, repeatable=True
            )
            if response.status_code != 200:
                raise self._transport.refused(route, response)
        except SGLangError as error:
            _log.warning("weight group %s left on the server: %s", group.group_name, error)
        finally:
            group.close()

    async def _broadcast_load(
        self, group: WeightBroadcastGroup, body: dict[str, Any], weights: Mapping[str, torch.Tensor]
    ) -> None:
        """Announce the tensors and broadcast them, together. Only a refusal after a complete
        broadcast leaves the group's ranks in step; after any other failure the group is discarded."""
        sent = _in_thread(group.broadcast, list(weights.items()))
        try:
            await self._alongside(
                "/update_weights_from_distributed",
                body,
                self._update_timeout_s,
                sent,
                "the weight broadcast",
                settle_on_refusal=True,
            )
        except BaseException as error:
            in_step = sent.done() and not sent.cancelled() and sent.exception() is None
            if not (in_step and isinstance(error, SGLangRequestError)):
                if self._group is group:
                    self._group = None
                _discard(group, sent)
            raise

    async def _alongside(
        self,
        path: str,
        body: dict[str, Any],
        timeout_s: float,
        work: asyncio.Future[None],
        what: str,
        *,
        settle_on_refusal: bool,
    ) -> None:
        """POST `body` to `path` while `work` (this process's part of the same collective, on a
        thread) runs: the server answers only once its ranks are done, so both must run at once. The
        first failure of either ends the wait. With `settle_on_refusal`, a refusal first waits for
        `work` to end, at most the group's timeout: a server that refuses the tensors it received has
        received them all, so `work` ends at once and the group stays in step."""
        transport = self._transport
        where = transport.base + path
        call = asyncio.ensure_future(transport.request("POST", path, body, timeout_s, repeatable=False))
        try:
            # FIRST_COMPLETED, not FIRST_EXCEPTION: a refusal is an answer, not an exception.
            both: list[asyncio.Future[Any]] = [call, work]
            await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
            if work.done() and work.exception() is not None:
                raise SGLangUnavailable(
                    f"{what} with the SGLang server at {where} failed: {work.exception()}"
                ) from work.exception()
            response = await call
        finally:
            call.cancel()
        succeeded, message = transport.outcome(path, response)
        if succeeded or settle_on_refusal:
            await asyncio.wait([work])
            if work.exception() is not None:
                raise SGLangUnavailable(
                    f"{what} with the SGLang server at {where} failed: {work.exception()}"
                ) from work.exception()
        if not succeeded:
            raise SGLangRequestError(
                f"the SGLang server at {transport.base} refused {what}: {message}", response.status_code
            )

    async def _session_call(self, path: str, body: dict[str, Any]) -> bool:
        """`/begin_weight_update` or `/end_weight_update`; False when the server has no such route
        (SGLang before weight-update sessions, which takes distributed updates without one)."""
        transport = self._transport
        response = await transport.request("POST", path, body, self._control_timeout_s, repeatable=False)
        if response.status_code == 404:
            return False
        succeeded, message = transport.outcome(path, response)
        if not succeeded:
            raise SGLangRequestError(
                f"the SGLang server at {transport.base}{path} refused: {message}", response.status_code
            )
        return True

    async def _server_ranks(self) -> int:
        """The server's tensor-parallel size, from `/server_info` (`/get_server_info` on older servers)."""
        path, answer = await self._transport.get_json(
            "/server_info", "/get_server_info", self._control_timeout_s
        )
        ranks = positive_int(answer, "tp_size") if isinstance(answer, dict) else None
        if ranks is None:
            raise SGLangProtocolError(
                f"{self._transport.base}{path} has no tp_size to size the weight group with: "
                "set SGLangOptions.weight_group_ranks"
            )
        return ranks


def _in_thread(function: Callable[..., _T], *args: Any) -> asyncio.Future[_T]:
    """`function(*args)` on a daemon thread of its own, as a future of the running loop. Not the
    loop's executor: a collective stays blocked until its timeout, and nothing may wait for it at
    the loop's shutdown."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[_T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def run() -> None:
        result: Any = None
        error: BaseException | None = None
        try:
            result = function(*args)
        except BaseException as raised:
            error = raised
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody awaits the outcome
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="pacerl-weight-group", daemon=True).start()
    return future


def _discard(group: WeightBroadcastGroup, work: asyncio.Future[Any]) -> None:
    """Close `group` once `work` (its collective still running, perhaps until its timeout) ends,
    and take the outcome so that asyncio does not report it as never retrieved."""

    def close(done: asyncio.Future[Any]) -> None:
        if not done.cancelled():
            done.exception()
        group.close()

    work.add_done_callback(close)


def _local_address(base_url: str) -> str:
    """This machine's address on the route to the server's host. A UDP socket's connect only picks
    the route; nothing is sent."""
    url = httpx.URL(base_url)
    host = url.host
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        # IPv4 first: SGLang joins through "tcp://{master_address}:{master_port}", unbracketed.
        infos.sort(key=lambda info: info[0] != socket.AF_INET)
        family, kind, protocol, _, address = infos[0]
        with socket.socket(family, kind, protocol) as probe:
            probe.connect(address)
            return str(probe.getsockname()[0])
    except OSError as error:
        raise SGLangError(
            f"cannot tell this machine's address towards {host}: {error}; "
            "set SGLangOptions.weight_group_address"
        ) from None
