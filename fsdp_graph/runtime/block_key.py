"""What a reusable block's parameter reads and its body's key depend on, apart from the body itself
(`block_region`): the names a unit's swapped class and `unit`'s property reads meet on, the annotated read of a
parameter inside a body, and a unit's structural key. Kept below `unit` and `block_region`, which both use them, so
neither imports the other to read a constant."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from fsdp_graph.ir import REGION_PARAM_ANNOTATION
from fsdp_graph.ir.ops import UNSHARD_SIGNATURE
from fsdp_graph.runtime.flat_param import ParamSlot

REGION_FLATS = "_fsdp_region_flats"  # the gathered flats a unit's body reads while it runs (compiled only)
BLOCK_KEY = "_fsdp_block_key"  # the unit's structure, part of the key `_reuse_key` returns
CACHE_LAYER = "_fsdp_cache_layer"  # the layer index a transformers layer addresses its KV cache with
STRICT = "_fsdp_reuse_strict"  # reuse_blocks=True: a unit that cannot share a body raises instead of warning

_PLAIN = (bool, int, float, str, type(None))
_UNKEYED = frozenset({"training", BLOCK_KEY, CACHE_LAYER, STRICT})
# transformers' layers keep their index only to address a KV cache (`cache.update(..., self.layer_idx)`, read
# nowhere else in forward in the families tested). In a shared body the cache is a fresh empty one, whose answers do
# not depend on the index, and its updates are replayed outside with the caller's own index (`block_cache`): an
# update at another index refuses the body, so the traced layer's index is never baked into another layer's call.
_CACHE_INDEX = frozenset({"layer_idx"})


def region_param(
    param_of: Callable[[torch.Tensor, ParamSlot], torch.Tensor], flat: torch.Tensor, slot: ParamSlot
) -> torch.Tensor:
    """`param_of(flat, slot)`, annotated as a parameter read inside a body (`block_region`'s docstring says why)."""
    with torch.fx.traceback.annotate(REGION_PARAM_ANNOTATION):
        return param_of(flat, slot)


def block_key(unit: nn.Module) -> int:
    """What a body traced for one unit bakes in, as an int: every submodule's class and plain attributes, its
    buffers' metadata, where each parameter lives in which flat parameter, the flats' gather facts (not the
    unit's name) and which of their parameters are frozen. Units with equal keys share one body; a change of
    `requires_grad` after fully_shard computes the key again (`unit.sync_requires_grad`)."""
    parts: list = []
    for name, module in unit.named_modules():
        cls = getattr(type(module), "_fsdp_original_class", type(module))
        skipped = _UNKEYED | (_CACHE_INDEX if cls.__module__.startswith("transformers.") else frozenset())
        attrs = sorted((k, v) for k, v in vars(module).items() if isinstance(v, _PLAIN) and k not in skipped)
        buffers = [
            (b_name, None if b is None else (tuple(b.shape), b.dtype, b.device))
            for b_name, b in module._buffers.items()
        ]
        views = sorted((p, spec.index, spec.slot) for p, spec in module.__dict__.get("_fsdp_views", {}).items())
        parts.append((name, cls.__module__, cls.__qualname__, tuple(attrs), tuple(buffers), tuple(views)))
    for state in unit.__dict__["_fsdp_states"]:
        static = dict(zip(UNSHARD_SIGNATURE.names[1:], state.static_unshard_args))
        static.pop("unit", None)
        layout = state.layout
        slots = tuple((tuple(s.shape), s.offset, *((s.dim,) if s.dim else ())) for s in layout.slots)
        frozen = (state.flat_shard.requires_grad, state.detached_slots)  # a body bakes in which reads are detached
        parts.append((sorted(static.items(), key=str), layout.kind, layout.world, layout.shard_numel, slots, frozen))
    return hash(repr(parts))
