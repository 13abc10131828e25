"""What differs between the torch releases fsdp_graph supports (2.11 to 2.13), found by looking for each feature,
never by version number.

Each probe looks once. Where a feature is missing, the caller takes the best path that exists, and `note_missing`
says once per process, in one warning, what is off and why. Call sites stay one line; the probes live here.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

_NOTED: set[str] = set()


class TorchFeatureWarning(UserWarning):
    """A torch feature fsdp_graph uses is missing from the installed torch; the message says what is off."""


def note_missing(feature: str, consequence: str) -> None:
    """Warn once per process that `feature` is missing from this torch and what that turns off (`consequence`)."""
    if feature in _NOTED:
        return
    _NOTED.add(feature)
    warnings.warn(
        f"fsdp_graph: torch {torch.__version__} has no {feature}: {consequence}", TorchFeatureWarning, stacklevel=3
    )


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """`dist.all_gather_single`: torch 2.13's name for `all_gather_into_tensor` (deprecated there), the only name in
    torch 2.11 and 2.12. Same arguments, same result. Looked up at each call, so a test's stand-in is called."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def _accepts(fn: Callable, parameter: str) -> bool:
    try:
        return parameter in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


@functools.cache
def has_reuse_hash_fn() -> bool:
    """torch.compiler.nested_compile_region(..., reuse_hash_fn=) (torch 2.13): a body is reused by a key the caller
    computes, even though it has side effects that make Dynamo's own reuse check refuse it."""
    return _accepts(torch.compiler.nested_compile_region, "reuse_hash_fn")


def has_single_use_region_inlining() -> bool:
    """torch._dynamo.config.inline_single_use_invoke_subgraph (torch 2.13): Dynamo inlines a compile region called
    once; the switch turns it off."""
    import torch._dynamo.config as dynamo_config

    return hasattr(dynamo_config, "inline_single_use_invoke_subgraph")


def keep_single_use_regions() -> None:
    """Dynamo keeps a compile region called once as a region, in every compile of this process after the call."""
    import torch._dynamo.config as dynamo_config

    if has_single_use_region_inlining():
        dynamo_config.inline_single_use_invoke_subgraph = False


def nested_compile_region(fn: Callable, reuse_hash_fn: Callable, **options) -> Callable:
    """`torch.compiler.nested_compile_region(fn, reuse_hash_fn=...)`. Without `reuse_hash_fn` (torch 2.11) the region
    is made without it: Dynamo then traces the body at every call and installs one subgraph per distinct traced graph,
    so identical blocks still share one body, which AOT autograd and Inductor compile once; only Dynamo's tracing
    grows with the depth. `note_shared_bodies` says so once. `options` (`max_reuse_entries`) go with `reuse_hash_fn`
    and only where the installed torch takes them."""
    region = torch.compiler.nested_compile_region
    if has_reuse_hash_fn():
        taken = {name: value for name, value in options.items() if _accepts(region, name)}
        return region(fn, reuse_hash_fn=reuse_hash_fn, **taken)
    return region(fn)


def note_shared_bodies() -> None:
    """Where `fully_shard` makes units share a compiled body: say once if this torch traces every one of them."""
    if not has_reuse_hash_fn():
        note_missing(
            "torch.compiler.nested_compile_region(reuse_hash_fn=)",
            "blocks of the same structure still share one compiled body (AOT autograd and Inductor compile it once), "
            "but Dynamo traces the body again at every block, so the first compile takes longer with depth than on "
            "torch 2.13",
        )


def saved_storage_data(metadata, directory: str) -> dict:
    """`storage_data` of the `Metadata` that `dcp.save` returned for the checkpoint it wrote to `directory`. torch
    2.13's FileSystemWriter.finish fills it in the object `dcp.save` returns; torch 2.11's fills a copy
    (`dataclasses.replace`) and returns the original without it, so it is read back from the `.metadata` file the
    coordinator wrote (nothing is lost either way)."""
    if metadata.storage_data is not None:
        return metadata.storage_data
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(directory).read_metadata().storage_data


def mesh_dim_layout(mesh_layout, dim: int):
    """Mesh dimension `dim` of a DeviceMesh's `_layout` as a one-dimensional mesh layout, whose `remap_to_tensor`
    lists that dimension's groups over the world. torch 2.13's `_MeshLayout` is a sequence of `_FlatLayout` axes and
    a slice keeps the mesh type; torch 2.11's is a CuTe layout whose item is already one (a slice is refused)."""
    from torch.distributed import _mesh_layout

    if hasattr(_mesh_layout, "_FlatLayout"):
        return mesh_layout[dim : dim + 1]
    return mesh_layout[dim]


def side_effect_record(tracer) -> object | None:
    """Where a Dynamo (sub)tracer recorded its first externally visible side effect (torch 2.13's
    `SubgraphTracer.side_effect_stack`; None: none yet, or a torch without the record, 2.11, whose
    nested_compile_region returns a body's intermediates whatever it wrote)."""
    return getattr(tracer, "side_effect_stack", None)


def clear_side_effect_record(tracer) -> None:
    """Forget the (sub)tracer's record of a side effect (see `side_effect_record`)."""
    if hasattr(tracer, "side_effect_stack"):
        tracer.side_effect_stack = None


def mutated_sources(side_effects) -> set:
    """The sources of the pre-existing Python objects a Dynamo trace has written so far (attributes as `AttrSource`s,
    lists and dicts by their own source): torch 2.13's `SideEffects.mutated_sources`; derived for torch 2.11, whose
    `SideEffects` keeps attribute writes in `store_attr_mutations` and marks other writes on each variable."""
    if hasattr(side_effects, "mutated_sources"):
        return set(side_effects.mutated_sources)
    from torch._dynamo.source import AttrSource

    sources = {
        AttrSource(variable.source, name)
        for variable, names in side_effects.store_attr_mutations.items()
        if variable.source is not None
        for name in names
    }
    for variable in side_effects.id_to_variable.values():
        if variable.source is None or side_effects.is_attribute_mutation(variable):
            continue
        if side_effects.is_modified(variable):
            sources.add(variable.source)
    return sources


def graph_module_generating_code_on_use(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A GraphModule of `graph` whose Python code is generated when first needed (a call, `.code`), not now: torch's
    `_LazyGraphModule` (2.11 and 2.13 have it); a release without it gets a plain GraphModule, generated at once."""
    lazy = getattr(getattr(torch.fx, "_lazy_graph_module", None), "_LazyGraphModule", None)
    return (lazy or torch.fx.GraphModule)(root, graph)
