"""Rank 0 of the torch.distributed group through which an SGLang server receives weights by broadcast.

The server's side, in sglang 0.5.23 (the version pyproject's `sglang` extra pins):

- `python/sglang/srt/entrypoints/http_server.py`: `POST /init_weights_update_group`,
  `/begin_weight_update`, `/update_weights_from_distributed` and `/end_weight_update`, each answering
  `{"success", "message"}` (HTTP 400 when `success` is false); `POST /destroy_weights_update_group`
  with `{"group_name"}`.
- `python/sglang/srt/managers/io_struct.py`: `InitWeightsUpdateGroupReqInput` (`master_address`,
  `master_port`, `rank_offset`, `world_size`, `group_name`, `backend`),
  `UpdateWeightsFromDistributedReqInput` (`names`, `dtypes`, `shapes`, `group_name`, `flush_cache`,
  `abort_all_requests`, `weight_version`, `load_format`, `selector`), `BeginWeightUpdateReqInput`
  (`selector`), `EndWeightUpdateReqInput`.
- `python/sglang/srt/managers/scheduler_components/weight_updater.py`: a distributed update outside
  a begin/end weight-update session is refused; it receives, loads, records the weight version and
  flushes the cache (refused while requests still run).
- `python/sglang/srt/model_executor/model_runner_components/weight_updater.py`
  (`init_weights_update_group`, `receive_weights_from_distributed`): each tensor-parallel worker
  joins as rank `rank_offset + tp_rank` (no device bound: nccl connects lazily, at the first
  broadcast); for each name it allocates `torch.empty(shape, dtype=getattr(torch, dtype))` and
  receives it by one `broadcast(src=0, async_op=True)`, in the order of `names`, waits for all, then
  loads them with the model's `load_weights`.
- `python/sglang/srt/utils/common.py` (`init_custom_process_group`): the worker's group comes from a
  `tcp://master_address:master_port` rendezvous, a TCPStore *client* (rank 0 hosts the store), wrapped
  in `PrefixStore(group_name)`; torch's `_new_process_group_helper` then adds the prefixes
  `"{group_name}/"` and the device's `"cpu/"` (gloo) or `"cuda/"` (nccl) and builds the backend.

This side hosts that TCPStore and builds the same prefix chain and backend by hand, so the group is
neither torch.distributed's default group nor registered in its world: a trainer's own ranks (FSDP)
keep the default group, whether this process has one or not. Collectives go straight to the backend.

A blocked gloo collective ends only when its peer closes the connection or its timeout passes
(`abort()` and `shutdown()` do not wake it, torch 2.13), so every wait here is bounded by `timeout_s`.
Under nccl, torch's watchdog enforces the timeout and by default tears the process down.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

# torch.distributed re-exports these (its documented API); its type stubs declare them only here.
from torch._C._distributed_c10d import Backend, BroadcastOptions, PrefixStore, ProcessGroupGloo, TCPStore
from torch.distributed.distributed_c10d import GroupName

GroupBackend = Literal["gloo", "nccl"]

CARRIED_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
)  # fmt: skip
"""Element types both gloo and nccl broadcast (gloo refuses int16 and the float8 types)."""

_DEVICE_PREFIX: dict[str, str] = {"gloo": "cpu", "nccl": "cuda"}
"""The device key `_new_process_group_helper` files a single-backend group under, per backend."""


@dataclass(frozen=True)
class WeightManifest:
    """What `/update_weights_from_distributed` announces: one entry per tensor, in broadcast order."""

    names: tuple[str, ...]
    """Parameter names as the server's model knows them (Hugging Face names)."""
    dtypes: tuple[str, ...]
    """torch dtype names without the `torch.` prefix: the server resolves them with `getattr(torch, ...)`."""
    shapes: tuple[tuple[int, ...], ...]
    """Each tensor's full (unsharded) shape."""


def describe(weights: Mapping[str, torch.Tensor]) -> WeightManifest:
    """The manifest of `weights`, checked as the broadcast needs it: string names, plain full
    tensors (not sharded DTensors), element types both backends carry."""
    if not isinstance(weights, Mapping) or not weights:
        raise ValueError("weights must be a non-empty mapping of parameter name -> torch.Tensor")
    names, dtypes, shapes = [], [], []
    for name, tensor in weights.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"parameter names must be non-empty strings, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        if _is_dtensor(tensor):
            raise ValueError(
                f"{name}: a sharded DTensor; broadcast full tensors (DTensor.full_tensor() on the source)"
            )
        if tensor.dtype not in CARRIED_DTYPES:
            carried = ", ".join(_dtype_name(d) for d in CARRIED_DTYPES)
            raise ValueError(
                f"{name}: dtype {_dtype_name(tensor.dtype)} cannot be broadcast; use one of {carried}"
            )
        names.append(name)
        dtypes.append(_dtype_name(tensor.dtype))
        shapes.append(tuple(int(size) for size in tensor.shape))
    return WeightManifest(tuple(names), tuple(dtypes), tuple(shapes))


class WeightBroadcastGroup:
    """Rank 0 of a weight group: hosts the rendezvous store at `address:port` on construction (port 0
    picks a free one, see `port`), forms the group in `connect` once the other ranks join, then sends
    tensors with `broadcast`. Never touches torch.distributed's default group."""

    def __init__(
        self,
        *,
        address: str,
        port: int,
        world_size: int,
        group_name: str,
        backend: GroupBackend,
        timeout_s: float,
        device: torch.device | None = None,
    ) -> None:
        if not address:
            raise ValueError("address is empty")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535 (0: any free port), got {port!r}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
            raise ValueError(
                f"world_size must be an int >= 2 (this rank and the server's), got {world_size!r}"
            )
        if not group_name:
            raise ValueError("group_name is empty")
        if backend not in _DEVICE_PREFIX:
            raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
        if not 0 < timeout_s <= 86400:
            raise ValueError(f"timeout_s must be in (0, 86400], got {timeout_s!r}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend nccl needs a CUDA device in this process; use gloo on CPU")
        self.address = address
        self.world_size = world_size
        self.group_name = group_name
        self.backend: GroupBackend = backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = device or (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        )
        # wait_for_workers=False: the caller must learn the port before any worker can be told it.
        self._store: TCPStore | None = TCPStore(
            address, port, world_size, is_master=True, timeout=self.timeout, wait_for_workers=False
        )
        self._backend: Backend | None = None
        self._closed = False

    @property
    def port(self) -> int:
        """The port the rendezvous store listens on (the one picked when constructed with 0)."""
        if self._store is None:
            raise RuntimeError(f"the weight group {self.group_name!r} is closed")
        return int(self._store.port)

    def connect(self) -> None:
        """Form the group as rank 0; blocks until the other `world_size - 1` ranks have joined, at most
        `timeout_s` (then torch raises)."""
        self._check_open()
        if self._backend is not None or self._store is None:
            raise RuntimeError(f"the weight group {self.group_name!r} is already connected or closed")
        # The chain of prefixes a joining server builds: PrefixStore(group_name) in SGLang's
        # init_custom_process_group, then "{group_name}/" and the device key in torch's helper.
        store = PrefixStore(self.group_name, self._store)
        store = PrefixStore(f"{self.group_name}/", store)
        store = PrefixStore(f"{_DEVICE_PREFIX[self.backend]}/", store)
        backend: Backend
        if self.backend == "gloo":
            backend = ProcessGroupGloo(store, 0, self.world_size, self.timeout)
        else:
            from torch._C._distributed_c10d import ProcessGroupNCCL  # absent from CPU builds

            options = ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = self.timeout
            options.group_name = GroupName(self.group_name)
            backend = ProcessGroupNCCL(store, 0, self.world_size, options)
        # torch's helper does this on every rank; a backend may exchange the number through the store.
        backend._set_sequence_number_for_group()
        self._backend = backend

    def broadcast(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send each tensor by one broadcast from rank 0, in order (the order of the manifest the
        server was given); returns once every one is sent. A tensor is moved to the group's device
        one at a time, so the weights may live anywhere."""
        backend = self._connected()
        options = BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        options.timeout = self.timeout
        for name, tensor in weights:
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
            payload = tensor.detach().to(self.device).contiguous()
            try:
                # The stubs declare broadcast on ProcessGroup only; every Backend binds it too.
                backend.broadcast([payload], options).wait()  # type: ignore[attr-defined]
            except RuntimeError as error:
                raise RuntimeError(
                    f"broadcasting {name!r} in weight group {self.group_name!r}: {error}"
                ) from None
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # nccl's wait() only orders streams

    def close(self) -> None:
        """Drop the backend and the store (its server stops once no collective still running holds
        it). Idempotent. The group cannot be used afterwards."""
        self._closed = True
        self._backend = None
        self._store = None

    def _connected(self) -> Backend:
        self._check_open()
        if self._backend is None:
            raise RuntimeError(f"the weight group {self.group_name!r} is not connected: call connect() first")
        return self._backend

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the weight group {self.group_name!r} is closed")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)
