"""Per-parameter meshes and placements of one `fully_shard` call (issue 35): which mesh and dim each parameter is
sharded over, and the process groups each mesh gives.

A call has a default mesh (its `mesh=`), a unit may have its own (`UnitOptions.mesh`), and `shard_placement_fn` may
move any parameter to another mesh and shard dim (`ParamPlacement`, FSDP2's `ShardPlacementResult`). Each distinct
mesh is resolved once (`Meshes.entry`): its groups, its strategy (a 1-D mesh shards, a 2-D one is HSDP, whatever the
call's mesh is) and the placements its state-dict DTensors have. A unit then holds one flat parameter per mesh (and
per trainable/frozen), each gathered and reduced over its own mesh's groups.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from fsdp_graph.api.config import ParamPlacement, ShardingStrategy
from fsdp_graph.api.groups import Groups, post_forward_groups, resolve_groups, with_reduce_group


@dataclass(frozen=True, eq=False)
class MeshEntry:
    """One mesh of a call, resolved: its groups, the strategy on it, the placements of a `Shard(0)` parameter's
    state-dict DTensor on it (Shard over the shard dim, Replicate over replicas), and a label naming the flat
    parameters on it when it is not their unit's mesh."""

    mesh: DeviceMesh | None
    strategy: ShardingStrategy
    groups: Groups
    placements: tuple
    label: str

    def placements_for(self, dim: int) -> tuple:
        """The placements of a parameter sharded on `dim` over this mesh (FSDP2's `Shard(dim)`)."""
        return tuple(Shard(dim) if isinstance(p, Shard) else p for p in self.placements)


def state_dict_placements(strategy: ShardingStrategy) -> tuple:
    """The placements that describe a parameter as FSDP2 would: Shard(0) over the shard dim, Replicate over
    replicas (NO_SHARD: Replicate only)."""
    if strategy is ShardingStrategy.NO_SHARD:
        return (Replicate(),)
    if strategy.is_hybrid:
        return (Replicate(), Shard(0))
    return (Shard(0),)


def _strategy_on(mesh: DeviceMesh, strategy: ShardingStrategy) -> ShardingStrategy:
    """The call's strategy carried to another mesh: a 2-D mesh is HSDP, a 1-D one shards; resharding after
    forward (ZeRO-3 or ZeRO-2) and NO_SHARD are kept."""
    if strategy is ShardingStrategy.NO_SHARD:
        return strategy
    zero2 = strategy in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2)
    if mesh.ndim == 2:
        return ShardingStrategy._HYBRID_SHARD_ZERO2 if zero2 else ShardingStrategy.HYBRID_SHARD
    if mesh.ndim == 1:
        return ShardingStrategy.SHARD_GRAD_OP if zero2 else ShardingStrategy.FULL_SHARD
    raise ValueError(
        f"fully_shard: a parameter or unit mesh must be 1-D (FSDP) or 2-D (replicate, shard: HSDP), got "
        f"{mesh.ndim}-D {mesh.mesh_dim_names}."
    )


class Meshes:
    """The meshes of one call, each resolved once, in first-use order (every rank resolves them in the same order:
    making a gloo group is collective)."""

    def __init__(self, default: DeviceMesh | None, strategy: ShardingStrategy, separate_reduce_group: bool) -> None:
        self.strategy, self.separate = strategy, separate_reduce_group
        self.entries: list[MeshEntry] = []
        self.default = self._add(default, strategy)

    def entry(self, mesh: DeviceMesh | None) -> MeshEntry:
        if mesh is None:
            return self.default
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"fully_shard: a placement's or unit's mesh must be a DeviceMesh, got {type(mesh)}")
        for entry in self.entries:
            if entry.mesh is not None and entry.mesh == mesh:
                return entry
        return self._add(mesh, _strategy_on(mesh, self.strategy))

    def _add(self, mesh: DeviceMesh | None, strategy: ShardingStrategy) -> MeshEntry:
        groups = with_reduce_group(resolve_groups(mesh, strategy), self.separate)
        names = mesh.mesh_dim_names if mesh is not None else None
        label = "+".join(names) if names else f"mesh{len(self.entries)}"
        entry = MeshEntry(mesh, strategy, groups, state_dict_placements(strategy), label)
        self.entries.append(entry)
        return entry


@dataclass(frozen=True)
class Placed:
    """Where one parameter is sharded: its mesh entry and shard dim (non-negative)."""

    entry: MeshEntry
    dim: int = 0


def resolve_placement(
    param: nn.Parameter, fqn: str, unit_entry: MeshEntry, meshes: Meshes, shard_placement_fn: Callable | None
) -> Placed:
    """`shard_placement_fn(param)` (None, a `Shard`, a `ParamPlacement`) resolved against the unit's mesh."""
    result = shard_placement_fn(param) if shard_placement_fn is not None else None
    if result is None:
        return Placed(unit_entry)
    if isinstance(result, Shard) and type(result) is Shard:
        result = ParamPlacement(result)
    if not isinstance(result, ParamPlacement):
        raise TypeError(
            f"fully_shard: shard_placement_fn gave parameter '{fqn}' {result!r}; return None, a "
            "torch.distributed.tensor.Shard(dim) or a fsdp_graph.ParamPlacement(Shard(dim), mesh)."
        )
    placement = result.placement if result.placement is not None else Shard(0)
    if not isinstance(placement, Shard) or type(placement) is not Shard:
        raise TypeError(
            f"fully_shard: parameter '{fqn}' got the placement {placement!r}; only Shard(dim) is supported."
        )
    check_shard_dim(param, placement, fqn)
    ndim = max(len(param.shape), 1)
    return Placed(meshes.entry(result.mesh) if result.mesh is not None else unit_entry, placement.dim % ndim)


class ShardDimError(ValueError, AssertionError):
    """A placement naming no dim of its parameter: a ValueError, and the AssertionError FSDP2 raises for it."""


def check_shard_dim(param: nn.Parameter, placement: Shard, fqn: str) -> None:
    ndim = len(param.shape)
    if not -ndim <= placement.dim < max(ndim, 1):
        raise ShardDimError(
            f"fully_shard: shard_placement_fn gave parameter '{fqn}' of shape {tuple(param.shape)} the placement "
            f"{placement!r}, which names no dim of it."
        )


def param_placements(
    params: dict[int, nn.Parameter],
    uses: dict,
    assignment: dict[int, str],
    unit_entries: dict[str, MeshEntry],
    meshes: Meshes,
    shard_placement_fn: Callable | None,
) -> dict[int, Placed]:
    """Each parameter's mesh and shard dim: `shard_placement_fn`'s answer (asked once per distinct parameter, before
    anything is sharded, as FSDP2 asks it), else `Shard(0)` on its unit's mesh (`unit_entries`, by unit FQN)."""
    placed = {}
    for pid, param in params.items():
        module_fqn, _, name = uses[pid][0]
        fqn = f"{module_fqn}.{name}".lstrip(".")
        placed[pid] = resolve_placement(param, fqn, unit_entries[assignment[pid]], meshes, shard_placement_fn)
    return placed


def mesh_suffix(entry: MeshEntry, unit_entry: MeshEntry) -> str:
    """The suffix of a flat parameter's name on `entry` inside a unit whose mesh is `unit_entry`: none on the unit's
    own mesh (so a model on one mesh keeps its names), `[label]` on another."""
    return "" if entry is unit_entry else f"[{entry.label}]"


def post_forward_for(
    made: dict[tuple[int, int], tuple[str, str]], entry: MeshEntry, reshard: bool | int, name: str
) -> tuple[str, str] | None:
    """(piece group, node group) of `reshard_after_forward=k` on `entry`'s mesh, made once per mesh and k; None for
    a bool. k must divide that mesh's shard group too (it was checked against the unit's own)."""
    if isinstance(reshard, bool):
        return None
    if entry.groups.shard_world % reshard:
        raise ValueError(
            f"fully_shard: reshard_after_forward={reshard} does not divide the {entry.groups.shard_world} ranks of "
            f"the mesh {entry.label!r} that flat parameter '{name}' is sharded over; choose a k dividing every mesh "
            "of the unit, or True / False."
        )
    key = (id(entry), reshard)
    if key not in made:
        made[key] = post_forward_groups(entry.mesh, entry.strategy, entry.groups, reshard)
    return made[key]
