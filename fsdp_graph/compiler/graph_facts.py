"""Facts the backend reads off a Dynamo graph before compiling it: the gloo process groups its collectives run on,
the DTensor meshes' groups (tensor parallelism's) and the names the compiled graphs call them by,
`reshard_after_forward=k`'s piece sizes, and the checks that refuse a graph early (parameters never sharded, a
compression naming no unit of the graph)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_graph import ir
from fsdp_graph.api.config import Compression
from fsdp_graph.api.groups import dtensor_group_name
from fsdp_graph.ir import ops
from passes.fx_nodes import bind_args


def gloo_groups(gm: fx.GraphModule) -> frozenset[str]:
    """The process groups of this graph that run on gloo. They reduce by all-to-all (no native reduce-scatter), and
    they are serial: the schedule never has two collectives in flight on one of them (ProcessGroupGloo's worker
    threads corrupt the heap when two collectives finish together; docs/design-notes.md)."""
    names = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in ir.UNSHARD_TARGETS:
            args = bind_args(node)
            device = args["compute_device"]
            if device is None:  # gathers and reductions run where the shard is
                shard = args["shard"].meta.get("example_value") if isinstance(args["shard"], fx.Node) else None
                device = shard.device if isinstance(shard, torch.Tensor) else torch.device("cpu")
            for arg in ("group", "reduce_group", "replicate_group", "piece_group", "post_forward_group"):
                names.add((args[arg] or "", device))
    return frozenset(name for name, device in names if name and ops.is_gloo_group(name, device))


def user_gloo_groups(gm: fx.GraphModule) -> frozenset[str]:
    """The gloo process groups of the model's own functional collectives in this graph (torchtitan's token
    dispatch and combine all-to-alls on its "ep" mesh): serial like fully_shard's, so the schedule and
    `check_collectives` keep one collective in flight on each (the backward's all-to-alls run on the same groups)."""
    packets = {op.overloadpacket for op in ir.COLLECTIVES}
    names = set()
    for node in gm.graph.nodes:
        target = node.target
        # Dynamo records a traced functional collective as its overload packet; its group name is the last argument
        packet = target if isinstance(target, torch._ops.OpOverloadPacket) else getattr(target, "overloadpacket", None)
        if node.op != "call_function" or packet not in packets or not node.args:
            continue
        group = node.kwargs.get("group_name", node.args[-1])
        if not isinstance(group, str):
            continue
        source = node.args[0].meta.get("example_value") if isinstance(node.args[0], fx.Node) else None
        device = source.device if isinstance(source, torch.Tensor) else torch.device("cpu")
        if ops.is_gloo_group(group, device):
            names.add(group)
    return frozenset(names)


@dataclass(frozen=True)
class DTensorGroups:
    """The process groups of the meshes of the DTensors a graph makes (tensor parallelism's). `names`: {c10d's name:
    the name the compiled graphs use}; `coordinates`: (the mesh's group names, this rank's coordinate on it) per mesh."""

    names: dict[str, str]
    coordinates: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...]

    def key(self) -> str:
        """What the compiled code's cache key holds of them: the graphs' names, and this rank's coordinates."""
        return f"{sorted(self.names.values())}{sorted(self.coordinates)}"


def dtensor_groups(gm: fx.GraphModule, example_inputs) -> DTensorGroups:
    """The DTensor meshes' groups of `gm`. Their collectives first appear when AOT autograd traces the graph, as
    constants of the compiled code; c10d names this rank's groups of a mesh dimension differently on each rank (the
    tp groups [0, 1] and [2, 3] of a 2 x 2 mesh), so `passes.rename_groups` gives them rank-independent aliases
    (`api.groups.dtensor_group_name`), and ranks of other groups compile the same code, which one compile serves
    (`shared_compile`). The code DTensor traces may still depend on the rank's coordinate on the mesh (the slice of
    a replicated tensor it keeps, when it shards one), so the key keeps ranks of other coordinates apart: on a
    (dp, tp) mesh the ranks of one tp coordinate share a compile. Where the graph takes or returns a DTensor, AOT
    autograd's runtime wrappers (and a cached entry of them) hold its mesh, which names c10d's groups: the names
    stay c10d's, and ranks of other groups key, and compile, apart (handed another rank's code, one failed with
    "Could not resolve the process group registered under the name 3")."""
    values = [n.meta.get("example_value", n.meta.get("val")) for n in gm.graph.nodes]
    alias = not any(isinstance(value, DTensor) for value in [*example_inputs, *_output_values(gm)])
    names: dict[str, str] = {}
    coordinates = set()
    seen: set[int] = set()
    for value in [*values, *example_inputs]:
        mesh = getattr(value, "device_mesh", None)
        if not isinstance(value, torch.Tensor) or mesh is None or id(mesh) in seen:
            continue
        seen.add(id(mesh))
        mesh_names = []
        for dim in range(mesh.ndim):
            real = mesh.get_group(dim).group_name
            if real not in names:
                names[real] = dtensor_group_name(mesh, dim) if alias else real
            mesh_names.append(names[real])
        coordinates.add((tuple(mesh_names), tuple(mesh.get_coordinate() or ())))
    return DTensorGroups(names, tuple(sorted(coordinates)))


def _output_values(gm: fx.GraphModule) -> list:
    values: list = []
    for node in gm.graph.find_nodes(op="output"):
        fx.node.map_arg(node.args, lambda arg: values.append(arg.meta.get("example_value", arg.meta.get("val"))))
    return values


def piece_rows(gm: fx.GraphModule) -> dict[str, int]:
    """{node group: world / k} of the `reshard_after_forward=k` gathers in `gm` (before the reshard pass splits them):
    the node group gathers pieces of world / k shards."""
    rows = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in ir.UNSHARD_TARGETS:
            a = bind_args(node)
            if a["post_forward_world"] > 1:
                rows[a["post_forward_group"]] = a["world"] // a["post_forward_world"]
    return rows


def check_compressible(gm: fx.GraphModule, compress: Compression) -> None:
    """Refuses a `units` list naming no unit of this graph, before compiling."""
    names = {bind_args(n)["unit"] for n in gm.graph.nodes if n.op == "call_function" and n.target in ir.UNSHARD_TARGETS}
    if compress.units is not None and names and not names & set(compress.units):
        raise ValueError(
            f"make_backend(compress=Compression(units={compress.units!r})): no such unit in this model; its units "
            f"are {sorted(names)} ('' is the root)"
        )


def check_sharded(gm: fx.GraphModule, example_inputs) -> None:
    if any(n.op == "call_function" and n.target in ir.UNSHARD_TARGETS for n in gm.graph.nodes):
        return
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    unsharded = []
    for node, value in zip(placeholders, example_inputs):
        if isinstance(value, nn.Parameter):
            grapharg = node.meta.get("grapharg")
            unsharded.append(grapharg.source.name if grapharg is not None else node.target)
    if unsharded:
        names = ", ".join(str(n) for n in unsharded[:5]) + (" ..." if len(unsharded) > 5 else "")
        raise RuntimeError(
            f"fsdp_backend: the compiled model uses parameters that fully_shard never sharded ({names}). "
            "Call fsdp_graph.fully_shard(model) before torch.compile(model, backend=fsdp_backend)."
        )
