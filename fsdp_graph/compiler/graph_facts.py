"""Facts the backend reads off a Dynamo graph before compiling it: the gloo process groups its collectives run on,
`reshard_after_forward=k`'s piece sizes, and the checks that refuse a graph early (parameters never sharded, a
compression naming no unit of the graph)."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from fsdp_graph import ir
from fsdp_graph.api.config import Compression
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


def dtensor_groups(gm: fx.GraphModule, example_inputs) -> frozenset[str]:
    """The process groups, by name, of the meshes of the DTensors the graph takes or makes (tensor parallelism's).
    Their collectives first appear when AOT autograd traces the graph, as constants of the compiled code: two ranks
    of one job whose groups are named differently (the tp groups [0, 1] and [2, 3] of a 2 x 2 mesh) can trace the
    same Dynamo graph, and compiled code, collective lists and a shared compile keyed without these names were
    handed from one to the other ("Could not resolve the process group registered under the name 3" on a warm
    cache)."""
    values = [n.meta.get("example_value", n.meta.get("val")) for n in gm.graph.nodes]
    names = set()
    for value in [*values, *example_inputs]:
        mesh = getattr(value, "device_mesh", None)
        if isinstance(value, torch.Tensor) and mesh is not None:
            names.update(mesh.get_group(dim).group_name for dim in range(mesh.ndim))
    return frozenset(names)


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
