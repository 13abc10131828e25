"""`.to()`, `.to_empty()`, `.double()`... called on a module inside a unit, not through the unit (torchtune's LoRA
recipe: `lora_linear.to_empty(device=...)` then `initialize_parameters()` on a model sharded on meta).

nn.Module's `_apply` converts each parameter on its own; the module's parameters are views of its unit's flat shard,
so that silently unlinked them: the module's init wrote tensors the gather never reads, and the optimizer trained
them apart from the model. Here (the `_apply` of every swapped module that owns views but holds no flat shard) the
views stay in the flat shard: a conversion that keeps the shard's dtype and device leaves them as they are (their
values too, where FSDP2's `to_empty()` would re-allocate them: the module's init writes them next); a flat shard
still on meta is allocated on the target device (in CPU memory under CPU offload), as the unit's own `to_empty()`
would; a dtype change, or a move of a materialised shard, concerns every parameter of the flat shard and is
refused, naming the module and its unit. A unit's own `_apply` (`unit._unit_apply`) converts its flat shards
whole and re-points the views, so when it recurses into its modules they convert only what is theirs alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn

from fsdp_graph.runtime import offload
from fsdp_graph.runtime.held import drop_held
from fsdp_graph.runtime.shard_binding import bind_flat_shard

_UNIT_APPLYING = [0]  # > 0 while a unit's `_apply` runs: its modules' views are its own business


@contextlib.contextmanager
def unit_applying() -> Iterator[None]:
    _UNIT_APPLYING[0] += 1
    try:
        yield
    finally:
        _UNIT_APPLYING[0] -= 1


def owner_apply(self: nn.Module, fn, recurse: bool = True):
    original = self._fsdp_original_class._apply
    if _UNIT_APPLYING[0]:
        return original(self, fn, recurse)
    own = {}
    for name, spec in self.__dict__.get("_fsdp_views", {}).items():
        state = spec.unit._fsdp_states[spec.index]
        if self._parameters.get(name) is state.views[spec.slot]:
            own[name] = state
    for name, state in own.items():
        shard = state.flat_shard
        probe = fn(torch.empty(0, dtype=shard.dtype, device=shard.device))
        offloaded = state.compute_device is not None  # then moves do not apply to shards, as for a unit
        if shard.device.type != "meta" and probe.dtype == shard.dtype and (probe.device == shard.device or offloaded):
            continue  # nothing of the shard changes
        if shard.device.type != "meta" or probe.dtype != shard.dtype:
            unit = type(state.module).__qualname__
            raise NotImplementedError(
                f"fsdp_graph: a conversion of {type(self).__name__} (parameter {name!r}) to {probe.dtype} on "
                f"{probe.device} was called on it alone, but its parameters are views of a flat shard of unit "
                f"{state.name!r} ({unit}) with {shard.dtype} on {shard.device}, shared with the unit's other "
                "parameters. Convert the unit (or the whole model) instead: model.to(...), model.to_empty(...)."
            )
        drop_held(state)
        state.staged.clear()
        # the unit's own `to_empty()`, for this shard
        new = torch.empty(shard.numel(), dtype=shard.dtype, device="cpu" if offloaded else probe.device)
        new = offload.pinned(new) if offloaded else new
        bind_flat_shard(state, new.requires_grad_(shard.requires_grad))
    hidden = {name: self._parameters[name] for name in own}
    for name in hidden:
        self._parameters[name] = None
    try:
        return original(self, fn, recurse)
    finally:
        self._parameters.update(hidden)
