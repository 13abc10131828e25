"""The process groups a `fully_shard` call gathers and reduces over, from its mesh (or the world)."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fsdp_graph import compat
from fsdp_graph.api.config import ShardingStrategy
from fsdp_graph.runtime.gloo import GLOO_BACKENDS, gloo_timeout, single_thread_gloo_group


@dataclass(frozen=True)
class Groups:
    """Where a flat parameter is gathered (shard) and its gradient all-reduced afterwards (replicate)."""

    shard_name: str
    shard_world: int
    shard_rank: int
    replicate_name: str = ""
    replicate_world: int = 1
    reduce_name: str = ""  # a second group over the shard group's ranks for gradient reductions ("": the same)
    shard_partition: tuple[tuple[int, ...], ...] = ()  # every rank's shard group of the world, as rank lists


def with_reduce_group(groups: Groups, separate: bool) -> Groups:
    """`groups` plus, if asked, a duplicate of this rank's shard group for gradient reductions. Each shard group
    duplicates itself, so only its members take part: HYBRID makes one new group per rank, not R world-wide ones."""
    if not separate or groups.shard_world == 1:
        return groups
    shard_pg = dist.distributed_c10d._resolve_process_group(groups.shard_name)
    reduce = duplicate_group(shard_pg)
    return dataclasses.replace(groups, reduce_name=rank_independent_name(reduce, groups.shard_partition, "reduce"))


ALIAS_PREFIX = "fsdp_graph"


def rank_independent_name(group: dist.ProcessGroup, rank_lists: Sequence[Sequence[int]], purpose: str) -> str:
    """The name this rank's graphs and ops call `group` by, one of `rank_lists` (every group of one mesh dimension
    over the world, this rank's among them): its own name when it is the only one, else an alias registered with
    c10d for this rank's group (`_register_process_group`), the same string on every rank of the world.

    Why: functional collectives name their group, and the name is a constant of the traced graph and of the code
    Inductor writes. HSDP's shard and replica groups, and a 1-D slice of a larger mesh, are several groups with
    names that differ per rank (c10d numbers groups as they are made), so every rank traced a graph of its own and
    compiled it (issue 36): at 1,024 ranks as 128 x 8, 1,024 compiles of one graph. Under the alias the graphs are
    the same wherever the model and shards are, so `shared_compile` compiles one for all and the others load it;
    each rank's registry resolves the alias to its own group, so loaded code runs on the loading rank's group.
    The alias is a digest of `purpose` and the partition: `purpose` keeps groups over the same ranks apart (a shard
    group and its reduce duplicate). Another group under the same alias on this rank (a second mesh of the same
    shape) takes the next free suffix; ranks make their groups in one order, so they number them alike."""
    partition = sorted(sorted(int(r) for r in ranks) for ranks in rank_lists)
    if len(partition) <= 1:
        return group.group_name
    digest = hashlib.sha1(repr((purpose, partition)).encode()).hexdigest()[:12]
    for index in itertools.count():
        alias = f"{ALIAS_PREFIX}:{purpose}:{digest}" + (f":{index}" if index else "")
        try:
            registered = dist.distributed_c10d._resolve_process_group(alias)
        except RuntimeError:  # free (never registered, or unregistered with its world)
            dist.distributed_c10d._register_process_group(alias, group)
            return alias
        if registered is group:
            return alias
    raise AssertionError("unreachable")


def dtensor_group_name(mesh: DeviceMesh, dim: int) -> str:
    """The name compiled graphs call this rank's group of DTensor mesh dimension `dim` by (tensor parallelism's
    collectives, which AOT autograd traces out of DTensor code): `rank_independent_name` of it where the mesh is
    a world mesh or a view of one whose other groups along `dim` are known (`_mesh_dim_ranks`), else c10d's own
    name. "dtensor" keeps it apart from fully_shard's groups over the same ranks (its gloo groups are copies)."""
    group = mesh.get_group(dim)
    if mesh._get_root_mesh().size() != dist.get_world_size() or not _slices_known(mesh):
        return group.group_name
    return rank_independent_name(group, _mesh_dim_ranks(mesh, dim), "dtensor")


def duplicate_group(pg: dist.ProcessGroup) -> dist.ProcessGroup:
    """A new process group with `pg`'s ranks and backend; every member of `pg` must call this, in the same order.
    Where the backend can split (NCCL with a device bound to the default group) it splits `pg`'s communicator
    (`dist.split_group`: no new bootstrap); elsewhere `new_group` over the same ranks, synchronising only them."""
    if _splittable(pg):
        split = dist.split_group(parent_pg=pg, split_ranks=[list(range(pg.size()))], group_desc="fsdp_reduce")
        if split is None:
            raise RuntimeError(f"fully_shard: splitting process group {pg.group_name} returned no group")
        return split
    ranks = dist.get_process_group_ranks(pg)
    # Without a bound device, new_group bootstraps NCCL through the store, so only the members need to call it; with
    # one it would split the default group, which every rank must join (that case is handled above). The backend
    # config keeps a mixed cpu:gloo,cuda:nccl group mixed, and a single-thread gloo copy (fsdp_graph.runtime.gloo) single-
    # thread; gloo_timeout keeps a gloo group's collective timeout (new_group's own default is 30 minutes).
    return dist.new_group(
        ranks,
        backend=dist.get_backend_config(pg),
        timeout=gloo_timeout(pg),
        use_local_synchronization=True,
        group_desc="fsdp_reduce",
    )


def _splittable(pg: dist.ProcessGroup) -> bool:
    """Whether `dist.split_group` can split `pg` (its own checks: a device bound to the default group, an
    accelerator, and a backend that supports splitting)."""
    if dist.distributed_c10d._get_default_group().bound_device_id is None or not torch.accelerator.is_available():
        return False
    try:
        return bool(pg._get_backend(torch.accelerator.current_accelerator()).supports_splitting)
    except RuntimeError:
        return False


def resolve_groups(mesh: DeviceMesh | None, strategy: ShardingStrategy) -> Groups:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "fully_shard needs an initialised process group: call "
            "torch.distributed.init_process_group('gloo' or 'nccl') first (torchrun sets the environment)."
        )
    if not isinstance(strategy, ShardingStrategy):
        raise TypeError(f"fully_shard: strategy must be a fsdp_graph.ShardingStrategy, got {strategy!r}")
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh)}")
    if mesh is not None:
        _check_spans_or_slices_world(mesh)
    if strategy.is_hybrid:
        if mesh is None or mesh.ndim != 2:
            raise ValueError(
                f"fully_shard: {strategy.name} needs a 2-D mesh (replicate, shard), e.g. "
                "init_device_mesh('cuda', (num_nodes, gpus_per_node)); got "
                f"{'no mesh' if mesh is None else f'a {mesh.ndim}-D mesh'}."
            )
        shard_lists, replicate_lists = _shard_rank_lists(mesh, strategy), _mesh_dim_ranks(mesh, 0)
        shard = _single_thread_if_gloo(mesh.get_group(1), shard_lists, "shard")
        replicate = _single_thread_if_gloo(mesh.get_group(0), replicate_lists, "replicate")
        return Groups(
            rank_independent_name(shard, shard_lists, "shard"),
            shard.size(),
            shard.rank(),
            rank_independent_name(replicate, replicate_lists, "replicate"),
            replicate.size(),
            shard_partition=_partition(shard_lists),
        )
    if mesh is not None and mesh.ndim != 1:
        raise ValueError(
            f"fully_shard: a {mesh.ndim}-D mesh needs strategy=ShardingStrategy.HYBRID_SHARD (or "
            "_HYBRID_SHARD_ZERO2); pass a 1-D mesh or mesh=None for other strategies."
        )
    group = dist.group.WORLD if mesh is None else mesh.get_group()
    lists = _shard_rank_lists(mesh, strategy)
    group = _single_thread_if_gloo(group, lists, "world")
    if strategy is ShardingStrategy.NO_SHARD:
        name = rank_independent_name(group, lists, "replicate") if group.size() > 1 else ""
        return Groups("", 1, 0, name, group.size())
    return Groups(
        rank_independent_name(group, lists, "shard"), group.size(), group.rank(), shard_partition=_partition(lists)
    )


def _partition(rank_lists: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(r) for r in ranks) for ranks in rank_lists)


def _shard_rank_lists(mesh: DeviceMesh | None, strategy: ShardingStrategy) -> list[list[int]]:
    """Every shard group of the world (HYBRID: one per replica; one otherwise), as rank lists."""
    if mesh is None:
        return [dist.get_process_group_ranks(dist.group.WORLD)]
    return _mesh_dim_ranks(mesh, 1 if strategy.is_hybrid else 0)


def post_forward_groups(mesh: DeviceMesh | None, strategy: ShardingStrategy, groups: Groups, k: int) -> tuple[str, str]:
    """(piece group, node group) of this rank for `reshard_after_forward=k`: the shard group of N ranks (in rank
    order) as an (N / k, k) arrangement. Node groups are k consecutive ranks (a node's GPUs, when k is the GPUs per
    node); the piece group is the N / k ranks at this rank's position in theirs (ranks j, j + k, ...). Every rank of
    the shard group calls this, in the same order; each group is made once, by its members only (gloo:
    single-thread copies, like the shard group's)."""
    lists = [sorted(ranks) for ranks in _shard_rank_lists(mesh, strategy)]
    nodes = [ranks[i : i + k] for ranks in lists for i in range(0, len(ranks), k)]
    pieces = [ranks[j::k] for ranks in lists for j in range(k)]
    shard_pg = dist.distributed_c10d._resolve_process_group(groups.shard_name)
    piece = rank_independent_name(_this_ranks_group(pieces, f"piece{k}", shard_pg), pieces, f"piece{k}")
    return piece, rank_independent_name(_this_ranks_group(nodes, f"node{k}", shard_pg), nodes, f"node{k}")


# (default group, purpose, this rank's group's ranks, the shard group) -> the group: made once, as gloo's are.
_post_forward_groups: dict[tuple[object, str, tuple[int, ...], str], dist.ProcessGroup] = {}


def _this_ranks_group(rank_lists: list[list[int]], purpose: str, like: dist.ProcessGroup) -> dist.ProcessGroup:
    """This rank's group among `rank_lists` (disjoint, each inside one shard group `like`), made once and by its
    members only. A world-wide `new_group` advances a counter on every rank that names the next world-wide group;
    pipeline stages with different `reshard_after_forward` would advance it differently, and later groups would
    get different names per stage and hang. The members share `like`, so they make the same calls in one order."""
    if dist.get_backend(like) in GLOO_BACKENDS:
        return single_thread_gloo_group(rank_lists, purpose, gloo_timeout(like), members_only=True)
    mine = next(ranks for ranks in rank_lists if dist.get_rank() in ranks)
    key = (dist.group.WORLD, purpose, tuple(mine), like.group_name)
    if key not in _post_forward_groups:
        _post_forward_groups[key] = _members_group(rank_lists, mine, purpose, like)
    return _post_forward_groups[key]


def _members_group(rank_lists: list[list[int]], mine: list[int], purpose: str, like: dist.ProcessGroup):
    if _splittable(like):  # new_group would split the default group, which every rank would have to join
        members = set(dist.get_process_group_ranks(like))
        inside = [[dist.get_group_rank(like, r) for r in ranks] for ranks in rank_lists if set(ranks) <= members]
        group = dist.split_group(parent_pg=like, split_ranks=inside, group_desc=f"fsdp_{purpose}")
        if group is None:
            raise RuntimeError(f"fully_shard: splitting process group {like.group_name} returned no group")
        return group
    return dist.new_group(
        mine, backend=dist.get_backend_config(like), use_local_synchronization=True, group_desc=f"fsdp_{purpose}"
    )


def _check_spans_or_slices_world(mesh: DeviceMesh) -> None:
    """A mesh spans the world, or is a view of one that does: named dimensions of it (`world_mesh["dp"]`), or a
    flattened or `_unflatten`ed view (torchtitan's `ParallelDims` makes every mesh so). Then the other ranks of the
    world hold other replicas of the same sharding, and the groups of every slice are known to every rank (from the
    mesh's layout over the world's ranks: `_mesh_dim_ranks`)."""
    world = dist.get_world_size()
    root = mesh._get_root_mesh()
    if root.size() != world:
        raise ValueError(
            f"fully_shard: the mesh has {mesh.size()} ranks but the process group has {world}; build it with "
            f"init_device_mesh(device_type, ({world},)) (or (replicate, shard) for HYBRID_SHARD), or pass named "
            "dimensions of a mesh over the whole world, e.g. init_device_mesh(device_type, (dp, tp), "
            'mesh_dim_names=("dp", "tp"))["dp"].'
        )
    if not _slices_known(mesh):
        raise ValueError(
            f"fully_shard: the mesh {mesh.mesh_dim_names} is a part of a {root.ndim}-D mesh {root.mesh_dim_names} "
            "that is not one of its named dimensions (a flattened or re-shaped dimension?), and this torch's "
            "DeviceMesh has no layout to find the other ranks' groups of it; pass "
            'world_mesh["name"] (or two names for HYBRID_SHARD).'
        )


def _slices_known(mesh: DeviceMesh) -> bool:
    """Whether the groups of every slice of `mesh` over the world can be listed (`_mesh_dim_ranks`): a world mesh,
    a view with a layout, or named dimensions of the world mesh."""
    return mesh._get_root_mesh() is mesh or _has_layout(mesh) or bool(_root_dims(mesh))


def _has_layout(mesh: DeviceMesh) -> bool:
    """Whether `mesh` describes itself over the world's ranks (torch's CuTe `_layout` and `_rank_map`: every
    flattened, unflattened or sliced view of a world mesh), so the groups of all its slices can be listed."""
    return getattr(mesh, "_layout", None) is not None and getattr(mesh, "_rank_map", None) is not None


def _root_dims(mesh: DeviceMesh) -> list[int] | None:
    """The dimensions of the world mesh that `mesh` is (None when they are not named dimensions of it)."""
    root = mesh._get_root_mesh()
    names, root_names = mesh.mesh_dim_names or (), root.mesh_dim_names or ()
    if len(names) != mesh.ndim or any(n not in root_names for n in names):
        return None
    return [root_names.index(n) for n in names]


def _mesh_dim_ranks(mesh: DeviceMesh, dim: int) -> list[list[int]]:
    """Every group along mesh dimension `dim` over the whole world, as rank lists (`mesh.get_group(dim)` is this
    rank's one): for a view of a larger mesh, that dimension's groups in every slice of the world mesh, read from
    the mesh's layout (the one DeviceMesh itself makes the groups from), or by name from the root mesh."""
    if _has_layout(mesh):
        groups = compat.mesh_dim_layout(mesh._layout, dim).remap_to_tensor(mesh._rank_map)
        return groups.reshape(-1, mesh.size(dim)).tolist()
    root = mesh._get_root_mesh()
    if root is mesh:
        return mesh.mesh.movedim(dim, -1).reshape(-1, mesh.mesh.size(dim)).tolist()
    root_dim = _root_dims(mesh)[dim]
    return root.mesh.movedim(root_dim, -1).reshape(-1, root.mesh.size(root_dim)).tolist()


def _single_thread_if_gloo(group: dist.ProcessGroup, rank_lists: list[list[int]], purpose: str) -> dist.ProcessGroup:
    """The graph's collectives on a gloo group run on a single-thread copy of it (`fsdp_graph.runtime.gloo`: gloo's worker
    threads race on shared state when two collectives of one group finish together)."""
    if group.size() == 1 or dist.get_backend(group) != "gloo":
        return group
    return single_thread_gloo_group(rank_lists, purpose, gloo_timeout(group))
