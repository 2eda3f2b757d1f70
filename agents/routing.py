"""`RoutedExperts`: the top-k experts an MoE rollout engine chose per token and layer, kept for R3
(Rollout Routing Replay, docs/algorithms.md §4) so the trainer's forward replays the engine's selection.

Row alignment, the one convention every producer and consumer shares: in a trajectory, the row of the
token at position t holds the routing of the forward pass that *produced* t, whose input was position
t − 1. A generated token therefore always has its row at the moment it is sampled, and the rows of
tokens 1..T−1 stacked are exactly SGLang's `(prompt + completion − 1, layers, top_k)` array (row p =
input position p), the layout the R3 trainer replays.
"""

from __future__ import annotations

import base64
import binascii
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch


def index_dtype(num_experts: int) -> np.dtype[np.unsignedinteger[Any]]:
    """The smallest unsigned integer dtype that holds every index in `[0, num_experts)`."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if num_experts - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ValueError(f"num_experts={num_experts} does not fit in uint32")


def _to_numpy(values: npt.ArrayLike | torch.Tensor) -> npt.NDArray[Any]:
    # A tensor can only exist once torch is imported; numpy-only callers never pay torch's import.
    if "torch" in sys.modules:
        import torch

        if isinstance(values, torch.Tensor):
            return values.detach().cpu().numpy()
    return np.asarray(values)


@dataclass(frozen=True, eq=False)
class RoutedExperts:
    """Expert indices of shape `[tokens, layers, top_k]`, compacted and read-only."""

    indices: npt.NDArray[np.unsignedinteger[Any]]
    """The indices; any integer array is accepted, then stored as a read-only copy in `index_dtype`."""
    num_experts: int
    """Experts per MoE layer; every index lies in `[0, num_experts)`."""

    def __post_init__(self) -> None:
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int):
            raise ValueError(f"num_experts must be an int, got {self.num_experts!r}")
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        array = self.indices
        if not isinstance(array, np.ndarray):
            raise ValueError(f"indices must be a numpy array, got {type(array).__name__}")
        if array.ndim != 3:
            raise ValueError(f"indices must have shape [tokens, layers, top_k], got shape {array.shape}")
        if array.dtype.kind not in "iu":
            raise ValueError(f"indices must be integers, got dtype {array.dtype}")
        if array.shape[1] < 1 or array.shape[2] < 1:
            raise ValueError(f"layers and top_k must be >= 1, got shape {array.shape}")
        if array.size and (array.min() < 0 or array.max() >= self.num_experts):
            raise ValueError(
                f"expert indices must lie in [0, {self.num_experts}), got [{array.min()}, {array.max()}]"
            )
        compact = np.array(array, dtype=index_dtype(self.num_experts), order="C", copy=True)
        compact.setflags(write=False)
        object.__setattr__(self, "indices", compact)

    @classmethod
    def from_array(
        cls,
        values: npt.ArrayLike | torch.Tensor,
        num_experts: int,
        *,
        num_layers: int | None = None,
        top_k: int | None = None,
    ) -> RoutedExperts:
        """From a numpy array, nested lists or a torch tensor (any device); checks the layers and
        top_k when given."""
        routes = cls(_to_numpy(values), num_experts)
        routes.check(num_layers=num_layers, top_k=top_k)
        return routes

    @classmethod
    def from_sglang(cls, b64: str, num_layers: int, top_k: int, num_experts: int) -> RoutedExperts:
        """Decode SGLang's `meta_info["routed_experts"]`: base64 of little-endian int32 in C order,
        `(prompt + completion − 1, num_layers, top_k)`. The rows of a completion of C tokens are the
        last C rows (see the module docstring)."""
        if num_layers < 1 or top_k < 1:
            raise ValueError(f"num_layers and top_k must be >= 1, got {num_layers} and {top_k}")
        try:
            raw = base64.b64decode(b64, validate=True)
        except binascii.Error as error:
            raise ValueError(f"routed_experts is not valid base64: {error}") from error
        row_bytes = 4 * num_layers * top_k
        if len(raw) % row_bytes:
            raise ValueError(
                f"routed_experts has {len(raw)} bytes, not a multiple of 4*{num_layers}*{top_k}={row_bytes}"
            )
        flat = np.frombuffer(raw, dtype="<i4")
        return cls.from_array(flat.reshape(-1, num_layers, top_k), num_experts)

    @staticmethod
    def concat(parts: Sequence[RoutedExperts]) -> RoutedExperts:
        """The parts stacked along tokens; they must agree on num_experts, layers and top_k."""
        if not parts:
            raise ValueError("concat needs at least one RoutedExperts")
        first = parts[0]
        for part in parts[1:]:
            if (part.num_experts, part.num_layers, part.top_k) != (
                first.num_experts,
                first.num_layers,
                first.top_k,
            ):
                raise ValueError(
                    f"cannot concat routes of (experts, layers, top_k) "
                    f"{(first.num_experts, first.num_layers, first.top_k)} and "
                    f"{(part.num_experts, part.num_layers, part.top_k)}"
                )
        return RoutedExperts(np.concatenate([part.indices for part in parts]), first.num_experts)

    def check(self, *, num_layers: int | None = None, top_k: int | None = None) -> None:
        """Raise `ValueError` unless the layers and top_k match the given expectations."""
        if num_layers is not None and self.num_layers != num_layers:
            raise ValueError(f"expected {num_layers} layers, got {self.num_layers}")
        if top_k is not None and self.top_k != top_k:
            raise ValueError(f"expected top_k={top_k}, got {self.top_k}")

    @property
    def num_tokens(self) -> int:
        """Rows (tokens)."""
        return int(self.indices.shape[0])

    @property
    def num_layers(self) -> int:
        """MoE layers per row."""
        return int(self.indices.shape[1])

    @property
    def top_k(self) -> int:
        """Experts chosen per token and layer."""
        return int(self.indices.shape[2])

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, tokens: slice) -> RoutedExperts:
        """The rows of a token range (Python slice semantics)."""
        if not isinstance(tokens, slice):
            raise TypeError(f"RoutedExperts is sliced by a token range, got {type(tokens).__name__}")
        return RoutedExperts(self.indices[tokens], self.num_experts)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RoutedExperts):
            return NotImplemented
        return self.num_experts == other.num_experts and np.array_equal(self.indices, other.indices)

    def __repr__(self) -> str:
        return (
            f"RoutedExperts(tokens={self.num_tokens}, layers={self.num_layers}, top_k={self.top_k}, "
            f"num_experts={self.num_experts}, dtype={self.indices.dtype})"
        )

    def to_json(self) -> dict[str, Any]:
        """Plain JSON: the raw little-endian bytes in base64, with dtype, shape and num_experts."""
        return {
            "num_experts": self.num_experts,
            "dtype": self.indices.dtype.name,
            "shape": list(self.indices.shape),
            "data": base64.b64encode(
                self.indices.astype(self.indices.dtype.newbyteorder("<")).tobytes()
            ).decode("ascii"),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RoutedExperts:
        """The inverse of `to_json`."""
        if set(data) != {"num_experts", "dtype", "shape", "data"}:
            raise ValueError(f"routed experts JSON needs num_experts, dtype, shape, data; got {sorted(data)}")
        if data["dtype"] not in ("uint8", "uint16", "uint32"):
            raise ValueError(f"routed experts dtype must be uint8, uint16 or uint32, got {data['dtype']!r}")
        dtype = np.dtype(data["dtype"]).newbyteorder("<")
        raw = base64.b64decode(data["data"], validate=True)
        shape = tuple(int(n) for n in data["shape"])
        if len(shape) != 3 or len(raw) != dtype.itemsize * int(np.prod(shape)):
            raise ValueError(f"routed experts data of {len(raw)} bytes does not match shape {shape}")
        return cls(np.frombuffer(raw, dtype=dtype).reshape(shape), int(data["num_experts"]))
