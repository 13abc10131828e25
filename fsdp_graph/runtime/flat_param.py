"""Layouts of one unit's flat parameter (DESIGN §4): how its parameters map onto the flat shard each rank holds.

Both layouts gather with ONE all-gather per unit (the gathered flat is `world` shards, rank after rank); they differ
in what a rank's shard holds and so in how a parameter is read back from the gathered flat:

- `FlatParamLayout` ("flat", FSDP1): parameters flattened and concatenated, padded; rank r holds a contiguous
  1/world range, so each parameter's local piece is a 1-D slice (possibly empty) and each unsharded parameter is a
  view of the gathered flat.
- `RowShardLayout` ("rows", FSDP2's per-parameter `Shard(0)`): rank r's shard is the concatenation of its row
  block of every parameter (torch.chunk semantics), so each local piece keeps the parameter's trailing dims, and
  each unsharded parameter is copied out of the rank-major gathered flat.

The rest of the code only uses the interface both share: `slots`, `numel`, `shard_numel`, `padded_numel`,
`local_range`, `local_shape`, `local_view`, `local_piece`, `shard_of`, `param_of`, `unflatten`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class ParamSlot:
    """One distinct parameter inside a unit's flat parameter.

    `fqns` lists every name it is reachable under (tied parameters are stored once). `offset`: where it starts in
    the layout's address space (flat: the full flat parameter; rows: every rank's shard).
    """

    fqns: tuple[str, ...]
    shape: torch.Size
    offset: int

    @property
    def numel(self) -> int:
        return self.shape.numel()


def _slots(named_shapes: list[tuple[tuple[str, ...], torch.Size]], size) -> tuple[ParamSlot, ...]:
    slots, offset = [], 0
    for fqns, shape in named_shapes:
        slots.append(ParamSlot(tuple(fqns), torch.Size(shape), offset))
        offset += size(torch.Size(shape))
    return tuple(slots)


@dataclass(frozen=True)
class FlatParamLayout:
    """Concatenation of flattened parameters in registration order, right-padded so that
    `padded_numel % world == 0`; rank r holds elements `[r * shard_numel, (r + 1) * shard_numel)`."""

    slots: tuple[ParamSlot, ...]
    world: int
    rank: int
    kind: ClassVar[str] = "flat"

    @staticmethod
    def build(named_shapes: list[tuple[tuple[str, ...], torch.Size]], world: int, rank: int) -> FlatParamLayout:
        return FlatParamLayout(_slots(named_shapes, torch.Size.numel), world, rank)

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def padded_numel(self) -> int:
        return self.numel + (-self.numel) % self.world

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world

    @property
    def shard_start(self) -> int:
        return self.rank * self.shard_numel

    def local_range(self, slot: ParamSlot) -> tuple[int, int]:
        """`[start, end)` of `slot` inside this rank's shard (empty range, start == end, if it holds none)."""
        lo = min(max(slot.offset - self.shard_start, 0), self.shard_numel)
        hi = min(max(slot.offset + slot.numel - self.shard_start, 0), self.shard_numel)
        return lo, max(lo, hi)

    def local_shape(self, slot: ParamSlot) -> torch.Size:
        lo, hi = self.local_range(slot)
        return torch.Size([hi - lo])

    def local_view(self, shard: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        """`slot`'s piece of this rank's `shard` (or of a shard-sized gradient), as the optimizer sees it."""
        lo, hi = self.local_range(slot)
        return shard[lo:hi]

    def local_piece(self, value: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        """This rank's piece of `value` (shaped like the parameter), shaped like `local_view`'s."""
        lo, hi = self.local_range(slot)
        start = self.shard_start + lo - slot.offset
        return value.detach().reshape(-1)[start : start + hi - lo]

    def flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The full padded flat parameter made of `tensors` (one per slot, in slot order)."""
        parts = [t.detach().reshape(-1) for t in tensors]
        pad = self.padded_numel - self.numel
        if pad:
            parts.append(parts[0].new_zeros(pad))
        return torch.cat(parts)

    def shard_of(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """This rank's shard of the flat parameter made of `tensors`, copying only the elements it owns (never
        the full flat parameter: with meta-device init, a unit is the most a rank ever holds unsharded)."""
        return _shard_of(self, tensors)

    def param_of(self, flat: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        """`slot`'s parameter read from the gathered flat parameter (differentiable): a view."""
        return flat[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each slot's parameter, in its original shape, read from the gathered flat parameter `flat`."""
        return [self.param_of(flat, s) for s in self.slots]


def _shard_of(layout, tensors: list[torch.Tensor]) -> torch.Tensor:
    first = tensors[0]
    shard = torch.zeros(layout.shard_numel, dtype=first.dtype, device=first.device)
    for slot, tensor in zip(layout.slots, tensors):
        lo, hi = layout.local_range(slot)
        if hi > lo:
            shard[lo:hi] = layout.local_piece(tensor, slot).reshape(-1)
    return shard


@dataclass(frozen=True)
class RowShardLayout:
    """FSDP2's `Shard(0)` per parameter inside one flat shard. A parameter with d0 rows has a block of
    `ceil(d0 / world)` rows on every rank (torch.chunk: rank r holds rows `[r * c, min((r + 1) * c, d0))`, the
    last ranks fewer or none; the rest of the block is zero padding). Rank r's shard is its blocks in slot order,
    so the gathered flat is `[rank 0's blocks][rank 1's blocks]...` and a parameter is a strided gather of one
    column range of the `(world, shard_numel)` matrix: a copy, unless the unit holds only that parameter."""

    slots: tuple[ParamSlot, ...]
    world: int
    rank: int
    kind: ClassVar[str] = "rows"

    @staticmethod
    def build(named_shapes: list[tuple[tuple[str, ...], torch.Size]], world: int, rank: int) -> RowShardLayout:
        for fqns, shape in named_shapes:
            if len(shape) == 0:
                raise ValueError(
                    f"fully_shard(layout='rows'): parameter '{fqns[0]}' is 0-dimensional and has no dim 0 to shard "
                    "(FSDP2 refuses it too). Store it with shape (1,), pass it in ignored_params, or use "
                    "layout='flat'."
                )
        return RowShardLayout(_slots(named_shapes, lambda s: -(-s[0] // world) * s[1:].numel()), world, rank)

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def shard_numel(self) -> int:
        return sum(self.block_numel(s) for s in self.slots)

    @property
    def padded_numel(self) -> int:
        return self.world * self.shard_numel

    def block_rows(self, slot: ParamSlot) -> int:
        return -(-slot.shape[0] // self.world)

    def block_numel(self, slot: ParamSlot) -> int:
        return self.block_rows(slot) * slot.shape[1:].numel()

    def local_rows(self, slot: ParamSlot) -> int:
        rows = self.block_rows(slot)
        return max(0, min(rows, slot.shape[0] - self.rank * rows))

    def local_range(self, slot: ParamSlot) -> tuple[int, int]:
        """`[start, end)` of this rank's rows of `slot` inside its shard (the block's padding excluded)."""
        return slot.offset, slot.offset + self.local_rows(slot) * slot.shape[1:].numel()

    def local_shape(self, slot: ParamSlot) -> torch.Size:
        return torch.Size([self.local_rows(slot), *slot.shape[1:]])

    def local_view(self, shard: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        lo, hi = self.local_range(slot)
        return shard[lo:hi].view(self.local_shape(slot))

    def local_piece(self, value: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        start = self.rank * self.block_rows(slot)
        return value.detach()[start : start + self.local_rows(slot)]

    def flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The gathered flat parameter made of `tensors`: every rank's shard, rank after rank."""
        ranks = [RowShardLayout(self.slots, self.world, r) for r in range(self.world)]
        return torch.cat([_shard_of(layout, tensors) for layout in ranks])

    def shard_of(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return _shard_of(self, tensors)

    def param_of(self, flat: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        """The copy-out (differentiable; its backward is the copy-in that lays a gradient out for the
        reduce-scatter): every rank's block of `slot`, stacked, the padding rows dropped."""
        rows, trailing = self.block_rows(slot), slot.shape[1:]
        blocks = flat.view(self.world, self.shard_numel)[:, slot.offset : slot.offset + self.block_numel(slot)]
        full = blocks.reshape(self.world * rows, *trailing)
        return full if self.world * rows == slot.shape[0] else full[: slot.shape[0]]

    def unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [self.param_of(flat, s) for s in self.slots]


Layout = FlatParamLayout | RowShardLayout
LAYOUTS: dict[str, type[FlatParamLayout] | type[RowShardLayout]] = {"flat": FlatParamLayout, "rows": RowShardLayout}
