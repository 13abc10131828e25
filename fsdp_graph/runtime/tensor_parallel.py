"""Tensor-parallel (DTensor) parameters inside flat shards (issue 14): FSDP over `world_mesh["dp"]` of a model
that `parallelize_module(model, world_mesh["tp"], plan)` made.

A DTensor parameter enters its unit's flat shard as its LOCAL tensor-parallel piece (`to_local()`), sharded again
over the FSDP mesh like any plain parameter (rows layout: `Shard(0)` row blocks of the local piece). In forward
the gathered local piece is wrapped back into a DTensor with the original mesh and placements
(`DTensor.from_local(..., run_check=False)`), so DTensor's own collectives and the plan's input/output hooks are
traced into the same graph as our gathers; its backward turns the DTensor gradient into the local one, which our
reduce-scatter then reduces over the FSDP mesh only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard


@dataclass(frozen=True, eq=False)
class TPSpec:
    """What a tensor-parallel parameter was before fully_shard: its mesh (one dimension of the world mesh), its
    placements there, and its global shape and stride."""

    mesh: DeviceMesh
    placements: tuple
    shape: torch.Size
    stride: tuple[int, ...]

    @property
    def shard_dim(self) -> int | None:
        """The dim the parameter is split on over `mesh` (None: replicated)."""
        placement = self.placements[0]
        return placement.dim if isinstance(placement, Shard) else None

    def wrap(self, local: torch.Tensor) -> DTensor:
        """The forward's view of the gathered local piece: the DTensor the plan made (differentiable)."""
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )


def tp_spec_of(param: DTensor, fqn: str, fsdp_mesh: DeviceMesh | None) -> TPSpec:
    """The spec of a DTensor parameter fully_shard can shard over `fsdp_mesh`, or a ValueError naming the parameter,
    what is wrong, and the fix."""
    mesh, placements = param.device_mesh, tuple(param.placements)
    where = f"fully_shard: parameter '{fqn}' is a DTensor on mesh {mesh.mesh_dim_names} with {placements}"
    if fsdp_mesh is None:
        raise ValueError(
            f"{where}, but fully_shard got no mesh. Pass the data-parallel dimension of the same world mesh, e.g. "
            'fully_shard(model, world_mesh["dp"]) after parallelize_module(model, world_mesh["tp"], plan).'
        )
    root = fsdp_mesh._get_root_mesh()
    names = mesh.mesh_dim_names or ()
    if mesh.ndim != 1 or len(names) != 1:
        raise ValueError(
            f"{where}: only tensor parallelism over one named dimension of the world mesh is supported "
            '(parallelize_module(model, world_mesh["tp"], plan)).'
        )
    own_dimension = _is_dimension_of(mesh, root)
    if not own_dimension and not _is_orthogonal_view(mesh, fsdp_mesh):
        raise ValueError(
            f"{where}, which is not a named dimension of the world mesh {root.mesh_dim_names} that fully_shard's "
            'mesh belongs to. Slice both from one mesh: world_mesh["tp"] for the plan, world_mesh["dp"] for '
            "fully_shard."
        )
    if names[0] in (fsdp_mesh.mesh_dim_names or ()):
        raise ValueError(
            f"{where}, the same dimension fully_shard shards over ({fsdp_mesh.mesh_dim_names}). Tensor and "
            'data parallelism need different dimensions: world_mesh["tp"] for the plan, world_mesh["dp"] for '
            "fully_shard."
        )
    placement = placements[0]
    if not isinstance(placement, Shard | Replicate) or type(placement) not in (Shard, Replicate):
        raise ValueError(
            f"{where}: only Shard(d) and Replicate() parameters are supported (a Partial parameter has no value "
            "of its own, a strided shard is not a plan's output). Use ColwiseParallel / RowwiseParallel / "
            "SequenceParallel styles that place parameters as Shard or Replicate."
        )
    if isinstance(placement, Shard):
        dim = placement.dim % param.ndim
        if param.shape[dim] % mesh.size() != 0:
            raise ValueError(
                f"{where}: its dim {dim} ({param.shape[dim]}) does not divide evenly over the {mesh.size()} "
                "tensor-parallel ranks; uneven tensor-parallel shards are not supported. Choose sizes divisible by "
                "the tensor-parallel degree."
            )
        placements = (Shard(dim),)
    # The world's own dimension, not the parameter's mesh object: that may hang from another, equal-valued world.
    # A view of the world made by `_unflatten` (torchtitan's "ep") is no dimension of it: then the mesh itself.
    return TPSpec(root[names[0]] if own_dimension else mesh, placements, param.shape, tuple(param.stride()))


def _is_dimension_of(mesh: DeviceMesh, root: DeviceMesh) -> bool:
    """Whether the 1-D `mesh` is the dimension of `root` with its name: same name, device type and ranks. Not by
    the root it was sliced from: DTensor caches specs by value, so a plan on one world's "tp" can leave its
    parameters on the equal "tp" mesh of a world made earlier in the process."""
    name = mesh.mesh_dim_names[0]
    if name not in (root.mesh_dim_names or ()) or mesh.device_type != root.device_type:
        return False
    return torch.equal(root[name].mesh, mesh.mesh)


def _is_orthogonal_view(mesh: DeviceMesh, fsdp_mesh: DeviceMesh) -> bool:
    """Whether the 1-D `mesh` is another view of `fsdp_mesh`'s world (torchtitan's `ParallelDims` unflattens one
    1-D world mesh into a dense and a sparse mesh, so its "ep" is no named dimension of the world) that meets
    `fsdp_mesh` in this rank only: then each piece of a parameter split over `mesh` is sharded over `fsdp_mesh`
    among ranks that all hold that same piece, as with a tp dimension of the world (expert parallelism: experts on
    "ep", sharded over "efsdp")."""
    if mesh.device_type != fsdp_mesh.device_type or mesh._get_root_mesh() != fsdp_mesh._get_root_mesh():
        return False
    shared = set(mesh.mesh.flatten().tolist()) & set(fsdp_mesh.mesh.flatten().tolist())
    return shared == {torch.distributed.get_rank()}


def state_dict_placements(spec: TPSpec, fsdp_mesh: DeviceMesh, fsdp_placements: tuple, local_rows: int) -> tuple:
    """(mesh, placements) of a tensor-parallel parameter's state-dict DTensor, as FSDP2 + TP make it: fully_shard's
    mesh dimensions then the tp one, sliced from the world mesh; fully_shard's placements then the tp placement.
    FSDP shards the tp-LOCAL tensor on dim 0, so when tp also shards dim 0 (ColwiseParallel) the dp row blocks are
    blocks of each tp piece: torch's `_StridedShard(0, split_factor=tp)` ("tp first, then dp"), exact only when the
    dp blocks are even (`local_rows`, the tp piece's dim 0, divisible by the dp shard size): otherwise a ValueError.
    A tp mesh that is no dimension of fully_shard's world (an `_unflatten`ed view: torchtitan's "ep") is joined to
    fully_shard's mesh by `DeviceMesh._concatenate`, as FSDP2 does."""
    root = fsdp_mesh._get_root_mesh()
    root_names = root.mesh_dim_names or ()
    names = (*(fsdp_mesh.mesh_dim_names or ()), *spec.mesh.mesh_dim_names)
    if not set(names) <= set(root_names):  # views of one world unflattened apart (torchtitan's EP): as FSDP2 joins them
        mesh = DeviceMesh._concatenate([fsdp_mesh, spec.mesh])
        return mesh, _spmd_placements(spec, fsdp_mesh, fsdp_placements, local_rows)
    positions = [root_names.index(n) for n in names]
    if positions != sorted(positions):
        raise ValueError(
            f"state_dict: the world mesh {root_names} orders the tensor-parallel dimension before fully_shard's "
            f"{fsdp_mesh.mesh_dim_names}; tensor-parallel state dicts need the data-parallel dimensions first, as "
            'torchtitan orders them: init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp")).'
        )
    return root[names], _spmd_placements(spec, fsdp_mesh, fsdp_placements, local_rows)


def _spmd_placements(spec: TPSpec, fsdp_mesh: DeviceMesh, fsdp_placements: tuple, local_rows: int) -> tuple:
    """fully_shard's placements (`Shard(d)` on its shard dim) then the tp one; where both split the same dim d, the
    dp blocks are blocks of each tp piece: `_StridedShard(d, split_factor=tp)`, even blocks only."""
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = list(fsdp_placements)
    for index, placement in enumerate(placements):
        if not isinstance(placement, Shard) or spec.shard_dim != placement.dim:
            continue
        dim, size = placement.dim, fsdp_mesh.size(index)
        local = local_rows if dim == 0 else spec.shape[dim] // spec.mesh.size()
        if local % size:
            raise ValueError(
                f"state_dict: a tensor-parallel parameter sharded on dim {dim} has {local} of it per tp rank, "
                f"not divisible by the {size} data-parallel ranks: its dp blocks are uneven, which no DTensor "
                "placement describes exactly. Choose sizes divisible by dp x tp."
            )
        placements[index] = _StridedShard(dim, split_factor=spec.mesh.size())
    return (*placements, spec.placements[0])


def tp_local_of(full: torch.Tensor, spec: TPSpec) -> torch.Tensor:
    """This rank's tensor-parallel piece of a full (global) parameter value."""
    if spec.shard_dim is None:
        return full
    return full.chunk(spec.mesh.size(), dim=spec.shard_dim)[spec.mesh.get_local_rank()]
