"""FSDP1-style flat parameter layout of one unit (DESIGN §4)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamSlot:
    """One distinct parameter inside a unit's flat parameter.

    `fqns` lists every name it is reachable under (tied parameters are stored once).
    """

    fqns: tuple[str, ...]
    shape: torch.Size
    offset: int

    @property
    def numel(self) -> int:
        return self.shape.numel()


@dataclass(frozen=True)
class FlatParamLayout:
    """Concatenation of flattened parameters in registration order, right-padded so that
    `padded_numel % world == 0`; rank r holds elements `[r * shard_numel, (r + 1) * shard_numel)`."""

    slots: tuple[ParamSlot, ...]
    world: int
    rank: int

    @staticmethod
    def build(named_shapes: list[tuple[tuple[str, ...], torch.Size]], world: int, rank: int) -> FlatParamLayout:
        slots, offset = [], 0
        for fqns, shape in named_shapes:
            slots.append(ParamSlot(tuple(fqns), torch.Size(shape), offset))
            offset += torch.Size(shape).numel()
        return FlatParamLayout(tuple(slots), world, rank)

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
        first = tensors[0]
        shard = torch.zeros(self.shard_numel, dtype=first.dtype, device=first.device)
        for slot, tensor in zip(self.slots, tensors):
            lo, hi = self.local_range(slot)
            if hi > lo:
                start = self.shard_start + lo - slot.offset
                shard[lo:hi] = tensor.detach().reshape(-1)[start : start + hi - lo]
        return shard

    def unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of the full flat parameter `flat`, one per slot, in their original shapes."""
        return [flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.slots]
