"""Each module's own state-dict code sees what it would see under FSDP2 (issue 24).

While a module that owns sharded parameters saves (`state_dict`) or loads (`_load_from_state_dict`), each of its
sharded parameters is, in its `_parameters`, an `nn.Parameter` DTensor on the FSDP mesh of the global shape
(`Shard(0)` over the shard group; `sharded.local_dtensor`). So `_save_to_state_dict` puts DTensors into the state
dict, the module's post-hooks (a fused-QKV split, key renames, casts) see and transform DTensors, and its load
pre-hooks and `_load_from_state_dict` overrides see DTensor parameters, as with torch's FSDP2. Outside those calls
the parameters are the sharded views again (what optimizers hold).

- Rows layout: each DTensor wraps its parameter's own row block (nothing moves), so a load writes the flat shard
  through it.
- Flat layout: a 1-D slice of a concatenation is no DTensor's local tensor, so the unit's flat parameter is
  gathered once per call (kept until the unit's own call returns), its parameters chunked into DTensors, and a load
  writes the loaded values back into the shard.

A load converts each entry of a sharded parameter to that parameter's DTensor spec after the module's own
pre-hooks ran (a full tensor is chunked, a DTensor of another placement or mesh redistributed), so the copy into
the parameter is local, and an entry a pre-hook built (a merged `wqkv`, `Replicate`) loads like any other.
`load_state_dict(assign=True)` (torchtune's and accelerate's loading into a model sharded on meta) copies the
loaded values into the flat shards too, allocating a meta shard once all its parameters arrived: the parameters stay
the same objects (FSDP2 makes the loaded tensors the parameters).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from fsdp_graph.runtime import offload
from fsdp_graph.runtime.dtensor_views import local_of
from fsdp_graph.runtime.held import drop_held
from fsdp_graph.runtime.shard_binding import bind_flat_shard
from fsdp_graph.runtime.unit import FlatParamState, ViewSpec
from fsdp_graph.state.sharded import gather_flat, gathered_dtensor, local_dtensor, local_range_of


@dataclass(eq=False)
class _Swapped:
    """One sharded parameter of a module, shown as `param` (a DTensor) in place of `view` during a state-dict call."""

    name: str
    state: FlatParamState
    slot: int
    view: nn.Parameter
    param: nn.Parameter


_gathered: dict[int, list[torch.Tensor]] = {}  # id(FlatParamState) -> its gathered parameters (flat layout)
_depth = [0]  # nesting of the state-dict calls running now: the outermost one clears `_gathered`


def _flat_values(state: FlatParamState) -> list[torch.Tensor]:
    values = _gathered.get(id(state))
    if values is None:
        values = _gathered[id(state)] = state.layout.unflatten(gather_flat(state, state.flat_shard.detach()))
    return values


def _as_dtensor(state: FlatParamState, slot: int, view: nn.Parameter) -> DTensor:
    if state.layout.kind == "rows":
        return local_dtensor(local_of(view).detach(), state, slot)
    return gathered_dtensor(_flat_values(state)[slot], state, slot)


def _sharded_params(module: nn.Module) -> list[tuple[str, FlatParamState, int, nn.Parameter]]:
    """The module's sharded parameters that are their views now (inside `summon_full_params` they are not)."""
    found = []
    for name, spec in module.__dict__.get("_fsdp_views", {}).items():
        spec: ViewSpec
        state: FlatParamState = spec.unit._fsdp_states[spec.index]
        view = state.views[spec.slot]
        if module._parameters.get(name) is view:
            found.append((name, state, spec.slot, view))
    return found


def _restore_exposed(module: nn.Module) -> None:
    """`fsdp_graph.fsdp2`'s unsharded parameters registered after a forward give way to the views first (FSDP2
    reshards before a state-dict call too)."""
    for spec in module.__dict__.get("_fsdp_views", {}).values():
        state: FlatParamState = spec.unit._fsdp_states[spec.index]
        if state.root.exposure is not None:
            state.root.exposure.restore([state])


@contextlib.contextmanager
def _dtensor_params(module: nn.Module) -> Iterator[list[_Swapped]]:
    """The module's sharded parameters as DTensor `nn.Parameter`s in its `_parameters` for the duration (tied names
    share one), and the gathers its call made freed at the end of the call that made them."""
    _depth[0] += 1
    own_states = [id(s) for s in module.__dict__.get("_fsdp_states", [])]
    _restore_exposed(module)
    swapped: list[_Swapped] = []
    made: dict[int, nn.Parameter] = {}
    try:
        with torch.no_grad():
            for name, state, slot, view in _sharded_params(module):
                param = made.get(id(view))
                if param is None:
                    param = made[id(view)] = nn.Parameter(_as_dtensor(state, slot, view), view.requires_grad)
                swapped.append(_Swapped(name, state, slot, view, param))
                module._parameters[name] = param
        yield swapped
    finally:
        for entry in swapped:
            module._parameters[entry.name] = entry.view
        _depth[0] -= 1
        for key in own_states if _depth[0] else list(_gathered):
            _gathered.pop(key, None)


class StateDictViews(nn.Module):
    """Mixed into the class of every module owning sharded parameters (`install`): its `state_dict` and
    `_load_from_state_dict` run with its sharded parameters as DTensors."""

    def state_dict(self, *args, **kwargs):
        with _dtensor_params(self):
            return super().state_dict(*args, **kwargs)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        assign = local_metadata.get("assign_to_params_buffers", False)
        with _dtensor_params(self) as swapped:
            loaded: list[_Swapped] = []
            hook = self.register_load_state_dict_pre_hook(_converter(swapped, prefix, loaded))
            try:  # runs the module's own pre-hooks first, then ours (the last registered), then the copies
                super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)
            finally:
                hook.remove()
            with torch.no_grad():
                for entry in loaded:
                    drop_held(entry.state)
                    if assign:  # nn.Module put the loaded tensor in `_parameters`: its values go into the shard
                        value = self._parameters.get(entry.name)
                        if value is not entry.param:
                            _write_assigned(entry, value, prefix, errors)
                    elif entry.state.layout.kind != "rows":  # the rows DTensors wrote the shard already
                        local = local_range_of(entry.param.detach(), entry.state, entry.slot)
                        local_of(entry.view).copy_(local)


def _write_assigned(entry: _Swapped, value: torch.Tensor, prefix: str, errors: list[str]) -> None:
    """`load_state_dict(assign=True)`: FSDP2 makes the loaded tensor the parameter; here every parameter is a view
    of its unit's flat shard (what the gather reads), so the loaded values are copied into the shard and the
    parameter stays the same object. A meta-device shard (a model sharded on meta) is allocated once all of its
    parameters have been loaded (`load_into_meta_shard`): until then they stay on meta, as FSDP2's do."""
    if value.dtype != entry.view.dtype:
        errors.append(
            f"load_state_dict(assign=True): '{prefix}{entry.name}' is {value.dtype} in the state dict but "
            f"{entry.view.dtype} in the model; fsdp_graph keeps each unit's parameters in one flat shard of one dtype, "
            "so assign cannot change a parameter's dtype. Cast the state dict's values to the parameter's dtype "
            "(or the model, with model.to(dtype), before loading)."
        )
        return
    local = local_range_of(value.detach(), entry.state, entry.slot)
    if entry.state.flat_shard.device.type == "meta":
        load_into_meta_shard(entry.state, entry.slot, local)
    else:
        local_of(entry.view).copy_(local)


def load_into_meta_shard(state: FlatParamState, slot: int, local: torch.Tensor) -> None:
    """`load_state_dict(assign=True)` into a flat shard still on the meta device (a model sharded on meta): keep
    `local` (this rank's piece of slot `slot`) until every slot has one, then allocate the shard where the values
    are (with CPU offload: in CPU memory, pinned where it can be), copy them in and re-point the views. A shard some
    of whose parameters were never loaded stays on meta, as those parameters would under FSDP2."""
    state.staged[slot] = local
    if len(state.staged) < len(state.layout.slots):
        return
    old = state.flat_shard
    device = torch.device("cpu") if state.compute_device is not None else local.device
    new = torch.zeros(state.layout.shard_numel, dtype=old.dtype, device=device)
    for index, piece in state.staged.items():
        state.layout.local_view(new, state.layout.slots[index]).copy_(piece)
    state.staged.clear()
    if state.compute_device is not None:
        new = offload.pinned(new)
    bind_flat_shard(state, new.requires_grad_(old.requires_grad))


def _converter(swapped: list[_Swapped], prefix: str, loaded: list[_Swapped]):
    """A load pre-hook bringing each sharded parameter's entry to its parameter's DTensor spec (same shape only:
    a mismatch is left for nn.Module's error, which names the key)."""

    def convert(module, state_dict, hook_prefix, *args) -> None:
        for entry in swapped:
            key = prefix + entry.name
            value = state_dict.get(key)
            if value is None or tuple(value.shape) != tuple(entry.param.shape):
                continue
            state_dict[key] = _to_spec(value, entry.param)
            if entry not in loaded:
                loaded.append(entry)

    return convert


def _to_spec(value: torch.Tensor, param: DTensor) -> DTensor:
    mesh, placements = param.device_mesh, tuple(param.placements)
    with torch.no_grad():
        if isinstance(value, DTensor):
            if value.device_mesh == mesh:
                return value if tuple(value.placements) == placements else value.redistribute(mesh, placements)
            value = value.full_tensor()
        device = value.device if param.device.type == "meta" else param.device  # a meta model takes the values' device
        return distribute_tensor(value.detach().to(device), mesh, placements, src_data_rank=None)


_MIXED: dict[type, type] = {}


def install(model: nn.Module) -> None:
    """Give every module of `model` that owns sharded parameters the `StateDictViews` behaviour (a subclass of its
    class, cached per class, named as it)."""
    for module in model.modules():
        if "_fsdp_views" not in module.__dict__ or isinstance(module, StateDictViews):
            continue
        cls = type(module)
        if cls not in _MIXED:
            _MIXED[cls] = type(cls.__name__, (StateDictViews, cls), {"__module__": cls.__module__})
        module.__class__ = _MIXED[cls]
