"""The embedded engine's KV cache and its packed attention (`pacerl.agents.engine.embedded`).

The running requests are the rows of one left-padded KV cache held in buffers that are allocated
once and grown rarely (`SlotCache`): every row's last input sits in the same column, so one decode
step writes one column for all rows. A packed forward (`SlotCache.pack`, `Packed`) feeds every running
row's last token and the joining prompts, unpadded, in one sequence of tokens; the engine's own
attention function (`register_slot_attention`, switched on for the engine's forwards only by
`slot_attention_on`) lets each running row attend over its own columns and each prompt causally
over itself, where the model's attention allows it (`packable`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask


@dataclass
class Packed:
    """One packed forward (`SlotCache.pack`): running rows in slots `[0, decode)` feed one token each
    in column `end`, then new rows feed their whole prompts, ending in that column."""

    decode: int
    """Running rows (the first `decode` tokens of the forward)."""
    start: int
    """The first column a running row attends to."""
    end: int
    """The column of the forward's last input, in every row."""
    mask: torch.Tensor | None
    """`[decode, 1, 1, end + 1 - start]`: the running rows' attention mask (None: no row has padding)."""
    width: int = 0
    """The longest new prompt; the new rows' inputs are left-padded to it."""
    real: torch.Tensor | None = None
    """`[prompt tokens]`: where the real tokens are among the new rows' `new rows * width` left-padded
    positions."""
    prompt_mask: torch.Tensor | None = None
    """`[new rows, 1, width, width]`: causal attention among each prompt's real tokens (padding
    queries see themselves only, to stay finite; they are dropped)."""
    query_index: torch.Tensor | None = None
    """`[new rows, width]`: the packed position of each left-padded prompt token."""
    slots: torch.Tensor | None = None
    """`[tokens]`: the slot each packed token's keys go to (None: decoding only)."""
    columns: torch.Tensor | None = None
    """`[tokens]`: the column they go to."""
    calls: int = 0
    """Attention calls made so far (one per layer)."""
    additive: torch.Tensor | None = None
    """`mask` as SDPA adds it to the scores (0 or -inf), made at the first layer for all of them."""

    def attend(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float | None
    ) -> torch.Tensor:
        """Attention output `[1, tokens, heads, head_dim]` of the packed `query` `[1, heads, tokens,
        head_dim]` against the cache's buffers `[slots, kv_heads, columns, head_dim]`: each running row
        over its own columns, each prompt causally over itself; the same arithmetic as transformers'
        SDPA attention on a left-padded batch."""
        self.calls += 1
        heads, kv_heads = query.shape[1], keys.shape[1]
        groups, rows = heads // kv_heads, self.decode
        outputs = []
        if rows:
            # One query per row: its heads grouped by key/value head (transformers' `pack_gqa`).
            grouped = query[0, :, :rows].transpose(0, 1).reshape(rows, kv_heads, groups, -1)
            if self.mask is not None and self.additive is None:
                self.additive = torch.zeros(self.mask.shape, dtype=query.dtype, device=query.device)
                self.additive.masked_fill_(~self.mask, float("-inf"))
            attended = torch.nn.functional.scaled_dot_product_attention(
                grouped,
                keys[:rows, :, self.start : self.end + 1],
                values[:rows, :, self.start : self.end + 1],
                attn_mask=self.additive,
                scale=scaling,
            )
            outputs.append(attended.reshape(rows, heads, -1))
        if self.query_index is not None:
            assert self.prompt_mask is not None and self.real is not None
            count, first = self.query_index.shape[0], self.end + 1 - self.width
            prompts = query[0][:, self.query_index].transpose(0, 1)  # [new rows, heads, width, head_dim]
            new = slice(rows, rows + count)
            attended = torch.nn.functional.scaled_dot_product_attention(
                prompts,
                keys[new, :, first : self.end + 1].repeat_interleave(groups, dim=1),
                values[new, :, first : self.end + 1].repeat_interleave(groups, dim=1),
                attn_mask=self.prompt_mask,
                scale=scaling,
            )
            flat = attended.transpose(1, 2).reshape(count * self.width, heads, -1)
            outputs.append(flat.index_select(0, self.real))  # [prompt tokens, heads, head_dim]
        return torch.cat(outputs)[None] if len(outputs) > 1 else outputs[0][None]


_SLOT_ATTENTION = "pacerl_slots"
"""The name the engine's attention function is registered under in transformers' AttentionInterface."""


def _slot_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    slot_plan: Packed | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The engine's attention function (transformers' AttentionInterface): a packed forward's attention
    (`Packed.attend`); any other call is transformers' SDPA attention."""
    if slot_plan is None:
        output: tuple[torch.Tensor, None] = sdpa_attention_forward(
            module, query, key, value, attention_mask, **kwargs
        )
        return output
    for name in ("sliding_window", "softcap", "s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise ValueError(f"the engine's packed attention does not support {name}")
    return slot_plan.attend(query, key, value, kwargs.get("scaling")), None


def register_slot_attention() -> None:
    """Register the engine's attention function in transformers' AttentionInterface (and SDPA's
    masks with it), under the name `slot_attention_on` switches a model to."""
    # With SDPA's masks, any other forward of the model while the switch is on computes as SDPA.
    AttentionInterface.register(_SLOT_ATTENTION, _slot_attention)
    AttentionMaskInterface.register(_SLOT_ATTENTION, sdpa_mask)


def slot_attention_on(config: Any) -> AbstractContextManager[None]:
    """The engine's attention (`register_slot_attention`) switched on for the decoder whose config is
    `config`, while inside."""
    return _attention(config, _SLOT_ATTENTION)


class _SlotLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]  # untyped in transformers
    """One decoder layer's keys and values, `[slots, kv_heads, columns, head_dim]`, in a `SlotCache`."""

    is_sliding = False

    def __init__(self, owner: SlotCache) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # untyped in transformers
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        slots, columns = self.owner.mask.shape
        self.keys = key_states.new_zeros((slots, key_states.shape[1], columns, key_states.shape[3]))
        self.values = value_states.new_zeros((slots, value_states.shape[1], columns, value_states.shape[3]))
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the forward's new columns in place; return the rows' keys and values it attends to."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = cast(torch.Tensor, self.keys), cast(torch.Tensor, self.values)
        owner = self.owner
        if owner.packed is not None:  # [1, kv_heads, tokens, head_dim]: each token to its row and column
            packed = owner.packed
            new_keys, new_values = key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)
            if packed.slots is None:  # decoding only: one column
                keys[: packed.decode, :, packed.end] = new_keys
                values[: packed.decode, :, packed.end] = new_values
            else:
                keys[packed.slots, :, packed.columns] = new_keys
                values[packed.slots, :, packed.columns] = new_values
            return keys, values
        rows, end = slice(owner.lo, owner.hi), owner.write + key_states.shape[2]
        keys[rows, :, owner.write : end] = key_states
        values[rows, :, owner.write : end] = value_states
        return keys[rows, :, owner.read : end], values[rows, :, owner.read : end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        """Past keys the forward's first query sees (a packed forward's attention ignores it)."""
        return 0 if self.owner.packed is not None else self.owner.write - self.owner.read

    def get_max_length(self) -> int:
        return -1


class SlotCache(Cache):
    """The running rows' KV cache in buffers allocated once and grown rarely: row r of the batch is
    slot r of every layer's buffers, left-padded so that every row's last input sits in column
    `end - 1` and a decode step writes column `end` for all rows.

    Rows join in the free slots after the last row, their prompts left-padded to end at `end` (the
    used columns move right first when a prompt is longer than `end`, which is rare: `end` only grows).
    A row that leaves is replaced by the last row (one row copied). Columns left of every row's first
    column are dropped by moving `start` (nothing copied). When column `end` runs past the buffers,
    the used columns move to the front, and the buffers double when less than a quarter would be free.
    `mask` marks, per slot and column, the positions a row attends to.
    """

    def __init__(self, num_layers: int, max_rows: int, device: torch.device) -> None:
        self.slot_layers = [_SlotLayer(self) for _ in range(num_layers)]
        super().__init__(layers=[*self.slot_layers])
        self.max_rows = max_rows
        self.mask = torch.zeros((0, 0), dtype=torch.bool, device=device)
        self.starts: list[int] = []
        """Each row's first column (its first real token)."""
        self.end = 0
        self.lo = self.hi = self.read = self.write = 0
        """The forward in progress: rows [lo, hi) write columns from `write` on and attend from `read`."""
        self.packed: Packed | None = None
        """The packed forward in progress, if it is one (`pack`)."""

    @property
    def rows(self) -> int:
        return len(self.starts)

    @property
    def start(self) -> int:
        """The first column any row uses."""
        return min(self.starts, default=self.end)

    def clear(self) -> None:
        """No rows (the buffers stay for the next ones)."""
        self.starts, self.end, self.packed = [], 0, None

    def join(self, mask: torch.Tensor, lengths: Sequence[int]) -> None:
        """Set up a forward that prefills new rows into the next free slots: `mask` `[rows, width]` marks
        their left-padded inputs' real tokens (`lengths` of them), which end at column `end` like every
        row's."""
        count, width = mask.shape
        rows = self.rows
        if not rows:
            self.end = 0
        self._make_room(rows + count, width)
        first, start = self.end - width, self.start
        if rows and first < start:  # the running rows do not attend to the columns added on their left
            self.mask[:rows, first:start] = False
        self.mask[rows : rows + count, min(first, start) : first] = False
        self.mask[rows : rows + count, first : self.end] = mask
        self.starts.extend(self.end - length for length in lengths)
        self.lo, self.hi, self.read, self.write = rows, rows + count, first, first

    def decode(self) -> torch.Tensor:
        """Set up a forward that feeds one token to every row; returns its attention mask."""
        rows = self.rows
        self._make_room(rows, 0)
        start, end = self.start, self.end
        self.mask[:rows, end] = True
        self.lo, self.hi, self.read, self.write = 0, rows, start, end
        return self.mask[:rows, start : end + 1]

    def advance(self) -> None:
        """The decode forward set up by `decode` or `pack` is done: its column is used."""
        self.end += 1
        self.packed = None

    def pack(self, mask: torch.Tensor | None, lengths: Sequence[int]) -> Packed:
        """Set up a packed forward: every running row feeds one token in column `end`, then new rows
        (`mask` `[rows, width]` marks the `lengths` real tokens of their left-padded prompts) feed their
        prompts into the next free slots, ending in that same column; the tokens go in that order."""
        rows, count = self.rows, len(lengths)
        width = 0 if mask is None else mask.shape[1]
        if not rows:
            self.end = 0
        self._make_room(rows + count, max(width - 1, 0))
        start, end = self.start, self.end
        device = self.mask.device
        self.mask[:rows, end] = True
        padded = any(first != start for first in self.starts)
        packed = Packed(rows, start, end, self.mask[:rows, None, None, start : end + 1] if padded else None)
        if mask is not None:
            first = end + 1 - width
            if rows and first < start:  # the running rows do not attend to the columns added on their left
                self.mask[:rows, first:start] = False
            self.mask[rows : rows + count, min(first, start) : first] = False
            self.mask[rows : rows + count, first : end + 1] = mask
            self.starts.extend(end + 1 - length for length in lengths)
            # Index tensors built on the host from `lengths`, then moved once (no device syncs).
            sizes = torch.tensor(lengths)
            padding = width - sizes
            steps = torch.arange(width)
            offsets = rows + sizes.cumsum(0) - sizes  # each prompt's first packed position
            real = (steps[None, :] >= padding[:, None]).flatten()
            within = torch.arange(int(sizes.sum())) - (offsets - rows).repeat_interleave(sizes)
            causal = steps[:, None] >= steps[None, :]
            itself = torch.eye(width, dtype=torch.bool, device=device)[None]
            packed.width = width
            packed.real = real.nonzero().squeeze(1).to(device)
            packed.prompt_mask = ((causal.to(device) & mask[:, None, :]) | itself)[:, None]
            queries = offsets[:, None] + steps[None, :] - padding[:, None]  # padding: any real token
            packed.query_index = queries.clamp(min=0).to(device)
            new_slots = torch.arange(rows, rows + count).repeat_interleave(sizes)
            packed.slots = torch.cat([torch.arange(rows), new_slots]).to(device)
            packed.columns = torch.cat(
                [torch.full((rows,), end), end + 1 - sizes.repeat_interleave(sizes) + within]
            ).to(device)
        self.packed = packed
        return packed

    def remove(self, leaving: Sequence[int]) -> tuple[list[int], list[int]]:
        """Drop the rows `leaving`; the last rows move into their slots. Returns the moves as
        (sources, destinations), for the caller's own per-row state."""
        rows, gone = self.rows, set(leaving)
        kept = rows - len(gone)
        holes = [row for row in sorted(gone) if row < kept]
        movers = [row for row in range(kept, rows) if row not in gone]
        start, end = self.start, self.end
        for hole, mover in zip(holes, movers, strict=True):
            first = self.starts[mover]  # left of it, the mask hides whatever the slot holds
            for buffer in self._buffers():
                buffer[hole, :, first:end] = buffer[mover, :, first:end]
            self.mask[hole, start:end] = self.mask[mover, start:end]
            self.starts[hole] = first
        del self.starts[kept:]
        return movers, holes

    def _buffers(self) -> list[torch.Tensor]:
        return [
            cast(torch.Tensor, tensor)
            for layer in self.slot_layers
            if layer.is_initialized
            for tensor in (layer.keys, layer.values)
        ]

    def _make_room(self, rows: int, width: int) -> None:
        """Slots for `rows` rows, `end >= width` and a free column at `end`; moves the used columns
        to the front of the buffers (growing them) only when that is not so already."""
        slots, columns = self.mask.shape
        if rows <= slots and width <= self.end < columns:
            return
        used_rows, start, end = self.rows, self.start, self.end
        new_end = max(end - start, width)
        new_slots = slots if rows <= slots else min(self.max_rows, max(rows, 2 * slots))
        new_columns = columns if 4 * (new_end + 1) <= 3 * columns else max(64, 2 * (new_end + 1))
        target = slice(new_end - (end - start), new_end)
        if (new_slots, new_columns) != (slots, columns):
            for layer in self.slot_layers:
                if layer.is_initialized:
                    layer.keys, layer.values = (
                        _moved(cast(torch.Tensor, old), used_rows, start, end, target, new_slots, new_columns)
                        for old in (layer.keys, layer.values)
                    )
            grown = self.mask.new_zeros((new_slots, new_columns))
            grown[:used_rows, target] = self.mask[:used_rows, start:end]
            self.mask = grown
        elif new_end != end:
            for buffer in self._buffers():
                buffer[:used_rows, :, target] = buffer[:used_rows, :, start:end].clone()
            self.mask[:used_rows, target] = self.mask[:used_rows, start:end].clone()
        self.starts = [first + new_end - end for first in self.starts]
        self.end = new_end


def _moved(
    old: torch.Tensor, rows: int, start: int, end: int, target: slice, slots: int, columns: int
) -> torch.Tensor:
    """A new zero buffer of `slots` x `columns` holding `old`'s used rows and columns at `target`."""
    new = old.new_zeros((slots, old.shape[1], columns, old.shape[3]))
    new[:rows, :, target] = old[:rows, :, start:end]
    return new


def packable(model: Any) -> bool:
    """Whether the engine's packed attention computes what the model's own does: causal attention
    over the whole context in every layer, through transformers' AttentionInterface."""
    config = model.config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None) or []
    return (
        getattr(config, "sliding_window", None) is None
        and all(kind == "full_attention" for kind in layer_types)
        and bool(getattr(model, "_supports_attention_backend", False))
    )


_switched: dict[int, tuple[int, Any]] = {}
"""Decoder configs whose attention engines have switched: id -> (forwards inside, what to restore)."""
_switch_lock = threading.Lock()


@contextmanager
def _attention(config: Any, implementation: str) -> Iterator[None]:
    """Run the decoder's attention (`config`: its config) through `implementation` inside the block.
    Engines sharing a model may overlap: the first one in switches, the last one out restores."""
    with _switch_lock:
        inside, previous = _switched.get(id(config), (0, config._attn_implementation))
        if not inside:
            config._attn_implementation = implementation
        _switched[id(config)] = (inside + 1, previous)
    try:
        yield
    finally:
        with _switch_lock:
            inside, previous = _switched.pop(id(config))
            if inside > 1:
                _switched[id(config)] = (inside - 1, previous)
            else:
                config._attn_implementation = previous
