"""Layouts of one unit's flat parameter (DESIGN §4): how its parameters map onto the flat shard each rank holds.

Both layouts gather with ONE all-gather per unit (the gathered flat is `world` shards, rank after rank); they differ
in what a rank's shard holds and so in how a parameter is read back from the gathered flat:

- `FlatParamLayout` ("flat", FSDP1): parameters flattened and concatenated, padded; rank r holds a contiguous
  1/world range, so each parameter's local piece is a 1-D slice (possibly empty) and each unsharded parameter is a
  view of the gathered flat.
- `RowShardLayout` ("rows", FSDP2's per-parameter `Shard(d)`, `Shard(0)` by default): rank r's shard is the
  concatenation of its block of every parameter (torch.chunk on the parameter's shard dim), so each local piece
  keeps the parameter's other dims, and each unsharded parameter is copied out of the rank-major gathered flat.

The rest of the code only uses the interface both share: `slots`, `numel`, `shard_numel`, `padded_numel`,
`local_range`, `local_shape`, `local_view`, `local_piece`, `shard_of`, `param_of`, `unflatten`, `slot_at`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from fsdp_graph.ir.ops import rows_copy_out


@dataclass(frozen=True)
class ParamSlot:
    """One distinct parameter inside a unit's flat parameter.

    `fqns` lists every name it is reachable under (tied parameters are stored once). `offset`: where it starts in
    the layout's address space (flat: the full flat parameter; rows: every rank's shard). `dim`: the dimension the
    rows layout shards it on (FSDP2's `Shard(dim)`; the flat layout has only 0).
    """

    fqns: tuple[str, ...]
    shape: torch.Size
    offset: int
    dim: int = 0
    # Derived once here, not per read: Dynamo traces every read of them in each compiled forward (one per parameter
    # per compile), where an attribute costs one instruction and the arithmetic dozens.
    numel: int = field(init=False, repr=False, compare=False)
    slice_numel: int = field(init=False, repr=False, compare=False)  # one slice along `dim`

    def __post_init__(self) -> None:
        object.__setattr__(self, "numel", self.shape.numel())
        rest = list(self.shape)
        if rest:
            del rest[self.dim]
        object.__setattr__(self, "slice_numel", torch.Size(rest).numel())


NamedShape = tuple[tuple[str, ...], torch.Size] | tuple[tuple[str, ...], torch.Size, int]
"""(fqns, shape) or (fqns, shape, shard dim): one parameter as a layout's `build` takes it."""


def _slots(named_shapes: list[NamedShape], size) -> tuple[ParamSlot, ...]:
    slots, offset = [], 0
    for fqns, shape, *dim in named_shapes:
        slot = ParamSlot(tuple(fqns), torch.Size(shape), offset, dim[0] if dim else 0)
        slots.append(slot)
        offset += size(slot)
    return tuple(slots)


def _slot_at(slots: tuple[ParamSlot, ...], position: int, size) -> int | None:
    index = bisect.bisect_right([slot.offset for slot in slots], position) - 1
    return index if index >= 0 and position < slots[index].offset + size(slots[index]) else None


@dataclass(frozen=True)
class FlatParamLayout:
    """Concatenation of flattened parameters in registration order, right-padded so that
    `padded_numel % world == 0`; rank r holds elements `[r * shard_numel, (r + 1) * shard_numel)`."""

    slots: tuple[ParamSlot, ...]
    world: int
    rank: int
    kind: ClassVar[str] = "flat"
    numel: int = field(init=False, repr=False, compare=False)
    padded_numel: int = field(init=False, repr=False, compare=False)
    shard_numel: int = field(init=False, repr=False, compare=False)

    @staticmethod
    def build(named_shapes: list[NamedShape], world: int, rank: int) -> FlatParamLayout:
        for fqns, _, *dim in named_shapes:
            if dim and dim[0] != 0:
                raise ValueError(
                    f"fully_shard(layout='flat'): parameter '{fqns[0]}' is to be sharded on dim {dim[0]} (Shard("
                    f"{dim[0]})); the flat layout cuts a unit's concatenated parameters into 1-D ranges and has no "
                    "shard dim. Use layout='rows' (the default)."
                )
        return FlatParamLayout(_slots(named_shapes, lambda slot: slot.numel), world, rank)

    def __post_init__(self) -> None:
        numel = sum(s.numel for s in self.slots)
        padded = numel + (-numel) % self.world
        _derive(self, numel=numel, padded_numel=padded, shard_numel=padded // self.world)

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

    def slot_at(self, position: int) -> int | None:
        """The slot holding element `position` of the gathered flat parameter (None: padding)."""
        return _slot_at(self.slots, position, lambda slot: slot.numel)


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
    """FSDP2's `Shard(d)` per parameter inside one flat shard (d = `slot.dim`, 0 unless a placement says otherwise).
    A parameter of size n on dim d has a block of `ceil(n / world)` slices on every rank (torch.chunk: rank r holds
    `[r * c, min((r + 1) * c, n))` on dim d, the last ranks fewer or none), stored contiguously at the start of its
    block, the rest zero padding. Rank r's shard is its blocks in slot order, so the gathered flat is
    `[rank 0's blocks][rank 1's blocks]...` and a parameter is a strided gather of one column range of the
    `(world, shard_numel)` matrix: a copy, unless the unit holds only that parameter and shards it on dim 0.
    "Rows" below are the slices of a parameter along its shard dim."""

    slots: tuple[ParamSlot, ...]
    world: int
    rank: int
    kind: ClassVar[str] = "rows"
    numel: int = field(init=False, repr=False, compare=False)
    padded_numel: int = field(init=False, repr=False, compare=False)
    shard_numel: int = field(init=False, repr=False, compare=False)

    @staticmethod
    def build(named_shapes: list[NamedShape], world: int, rank: int) -> RowShardLayout:
        for fqns, shape, *dim in named_shapes:
            if len(shape) == 0:
                raise ValueError(
                    f"fully_shard(layout='rows'): parameter '{fqns[0]}' is 0-dimensional and has no dim 0 to shard "
                    "(FSDP2 refuses it too). Store it with shape (1,), pass it in ignored_params, or use "
                    "layout='flat'."
                )
            if dim and not 0 <= dim[0] < len(shape):
                raise ValueError(
                    f"fully_shard: parameter '{fqns[0]}' of shape {tuple(shape)} cannot be sharded on dim {dim[0]}; "
                    f"a placement must name one of its dims (Shard(0) to Shard({len(shape) - 1}), or negative)."
                )
        return RowShardLayout(
            _slots(named_shapes, lambda slot: -(-slot.shape[slot.dim] // world) * slot.slice_numel), world, rank
        )

    def __post_init__(self) -> None:
        shard = sum(self.block_numel(s) for s in self.slots)
        _derive(self, numel=sum(s.numel for s in self.slots), padded_numel=self.world * shard, shard_numel=shard)

    def block_rows(self, slot: ParamSlot) -> int:
        return -(-slot.shape[slot.dim] // self.world)

    def block_numel(self, slot: ParamSlot) -> int:
        return self.block_rows(slot) * slot.slice_numel

    def local_rows(self, slot: ParamSlot, rank: int | None = None) -> int:
        rows = self.block_rows(slot)
        return max(0, min(rows, slot.shape[slot.dim] - (self.rank if rank is None else rank) * rows))

    def local_range(self, slot: ParamSlot) -> tuple[int, int]:
        """`[start, end)` of this rank's rows of `slot` inside its shard (the block's padding excluded)."""
        return slot.offset, slot.offset + self.local_rows(slot) * slot.slice_numel

    def local_shape(self, slot: ParamSlot, rank: int | None = None) -> torch.Size:
        return _with_dim(slot, self.local_rows(slot, rank))

    def local_view(self, shard: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        lo, hi = self.local_range(slot)
        return shard[lo:hi].view(self.local_shape(slot))

    def local_piece(self, value: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        start = min(self.rank * self.block_rows(slot), slot.shape[slot.dim])
        return value.detach().narrow(slot.dim, start, self.local_rows(slot))

    def flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The gathered flat parameter made of `tensors`: every rank's shard, rank after rank."""
        ranks = [RowShardLayout(self.slots, self.world, r) for r in range(self.world)]
        return torch.cat([_shard_of(layout, tensors) for layout in ranks])

    def shard_of(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return _shard_of(self, tensors)

    def param_of(self, flat: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        """The copy-out (differentiable; its backward is the copy-in that lays a gradient out for the
        reduce-scatter): every rank's block of `slot`, joined along its shard dim, the padding dropped."""
        # `block_rows` and `block_numel` written out: Dynamo inlines a call per parameter read in each compile
        world = self.world
        rows = -(-slot.shape[slot.dim] // world)
        width = rows * slot.slice_numel
        if slot.dim == 0:
            if world == 1 or rows <= 1 or width == self.shard_numel:
                # one block, one row a block, or the whole matrix: the parameter is a view of the flat, no copy
                blocks = flat.view(world, self.shard_numel)[:, slot.offset : slot.offset + width]
            else:  # a strided column range: copied, by one op (`ir.ops.rows_copy_out` says why)
                blocks = rows_copy_out(flat, world, self.shard_numel, slot.offset, width)
            full = blocks.view(world * rows, *slot.shape[1:])
            return full if world * rows == slot.shape[0] else full[: slot.shape[0]]
        blocks = flat.view(world, self.shard_numel)[:, slot.offset : slot.offset + width]
        # Shard(d), d > 0: each rank's block is its chunk, contiguous, so the blocks are stacked on a new leading dim
        # and moved to d. Uneven chunks: the full blocks so, then the one partial chunk (a prefix of its block).
        full_ranks = world if rows == 0 else min(world, slot.shape[slot.dim] // rows)
        padded = _with_dim(slot, rows)
        stacked = (blocks if full_ranks == world else blocks[:full_ranks]).view(full_ranks, *padded).movedim(0, slot.dim)
        joined = stacked.reshape(_with_dim(slot, full_ranks * rows))
        tail = slot.shape[slot.dim] - full_ranks * rows
        if not tail:
            return joined
        tail_shape = _with_dim(slot, tail)
        return torch.cat([joined, blocks[full_ranks, : tail_shape.numel()].view(tail_shape)], slot.dim)

    def unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [self.param_of(flat, s) for s in self.slots]

    def slot_at(self, position: int) -> int | None:
        """The slot whose block (on any rank) holds element `position` of the gathered flat parameter."""
        return _slot_at(self.slots, position % max(self.shard_numel, 1), self.block_numel)


def _derive(layout: object, **values: int) -> None:
    """Set a frozen layout's derived sizes, computed once (see `ParamSlot.numel`)."""
    for name, value in values.items():
        object.__setattr__(layout, name, value)


def _with_dim(slot: ParamSlot, size: int) -> torch.Size:
    """`slot`'s shape with `size` on its shard dim."""
    shape = list(slot.shape)
    shape[slot.dim] = size
    return torch.Size(shape)


Layout = FlatParamLayout | RowShardLayout
LAYOUTS: dict[str, type[FlatParamLayout] | type[RowShardLayout]] = {"flat": FlatParamLayout, "rows": RowShardLayout}
