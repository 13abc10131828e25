"""Process groups behind a plan's collectives: their sizes, ranks and roles, read from torch.distributed (the
fake process group included)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch.distributed as dist

from fsdp_graph.compiler.stage_passes import GraphReport
from fsdp_graph.runtime.unit import FlatParamState
from passes.cost import iter_collectives
from passes.fx_nodes import bind_args


def other_group_sizes(graphs: Sequence[GraphReport], known: Mapping[str, int]) -> dict[str, int]:
    """The sizes of the groups the graphs' other collectives run on (tensor parallel's all-reduces on the tp
    dimension, from DTensor), from the process groups themselves: without them they would be sized as the world."""
    sizes = {}
    for report in graphs:
        for node, _, _ in iter_collectives(report.graph):
            name = bind_args(node).get("group_name")
            if isinstance(name, str) and name not in known and name not in sizes:
                sizes[name] = dist.distributed_c10d._resolve_process_group(name).size()
    return sizes


def group_roles(states: Sequence[FlatParamState], groups: Sequence[str]) -> dict[str, str]:
    """Group name -> the mesh dimension it is this rank's group of ("dp", "tp", "efsdp", ...), matched by ranks (ours
    on gloo are copies of the mesh's groups, with other names): the dimensions of every mesh the flat parameters
    are on (per-parameter meshes included) and of their tensor- or expert-parallel parameters (torchtitan's "ep",
    whose all-to-alls are the model's own), then those of their world mesh; groups matching none are left out."""
    tp_meshes = [spec.mesh for s in states for spec in s.tp if spec is not None]
    meshes = list({id(m): m for s in states for m in (s.mesh, s.root.mesh) if m is not None}.values())
    meshes += list({id(m): m for m in tp_meshes if all(m is not other for other in meshes)}.values())
    by_ranks: dict[tuple[int, ...], str] = {}
    for mesh in [*meshes, *{id(r): r for r in (m._get_root_mesh() for m in meshes)}.values()]:
        for dim, name in enumerate(mesh.mesh_dim_names or ()):
            by_ranks.setdefault(tuple(dist.get_process_group_ranks(mesh.get_group(dim))), name)
    roles = {}
    for group in [g for g in groups if g] if by_ranks else ():
        ranks = tuple(dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(group)))
        if ranks in by_ranks:
            roles[group] = by_ranks[ranks]
    return roles


def group_ranks(group_sizes: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
    """Each group's global ranks (from the process groups, fake ones included): which nodes a collective spans."""
    ranks = {}
    for name in group_sizes:
        try:
            ranks[name] = tuple(dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(name)))
        except (RuntimeError, ValueError, KeyError):
            continue  # a group that is gone (or never was): costed as consecutive ranks
    return ranks
