"""The views `fully_shard` replaces parameters with, and a clear error for a silent mistake (issue 12): an optimizer
built BEFORE `fully_shard` holds the original parameters, which no longer belong to the model: they never get a
gradient and the optimizer trains nothing. `fully_shard` marks each replaced original, and a global optimizer step
pre-hook refuses to step an optimizer holding one.

Changing `requires_grad` on a sharded parameter is supported (FSDP2's fine-tuning idiom): the views are
`ShardedParameter`s (`ShardedDTensor`s in a model with tensor-parallel parameters, with the rows layout), which
tell their flat parameter at once (`unit.sync_requires_grad`), so the next forward, eager or compiled, reads the
frozen ones detached and the flat shard requires a gradient only while one of its views does.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.optim.optimizer import _foreach_supported_types as _optim_foreach_types
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._foreach_utils import _foreach_supported_types as _util_foreach_types

_REPLACED_BY = "_fsdp_replaced_by"
_CHECKED = "_fsdp_checked_param_count"
_requires_grad = torch._C.TensorBase.requires_grad


REQUIRES_GRAD_CHANGED = "_fsdp_on_requires_grad"  # in a view's __dict__: called with the view after a change


class _TracksRequiresGrad:
    """Reports a change of `requires_grad` to the callable its flat parameter left in the view's `__dict__`
    (`REQUIRES_GRAD_CHANGED`), after making it (`_fsdp_fqn`: the parameter's name, for messages)."""

    __slots__ = ()
    _fsdp_fqn: str = "?"

    @property
    def requires_grad(self) -> bool:
        return _requires_grad.__get__(self)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        changed = bool(value) != _requires_grad.__get__(self)
        _requires_grad.__set__(self, value)
        if changed:
            self._requires_grad_changed()

    def requires_grad_(self, requires_grad: bool = True):
        changed = bool(requires_grad) != _requires_grad.__get__(self)
        result = super().requires_grad_(requires_grad)
        if changed:
            self._requires_grad_changed()
        return result

    def _requires_grad_changed(self) -> None:
        report = self.__dict__.get(REQUIRES_GRAD_CHANGED)
        if report is not None:
            report(self)


class ShardedParameter(_TracksRequiresGrad, nn.Parameter):
    """A sharded parameter's view (this rank's piece of its unit's flat shard). Behaves as an `nn.Parameter`;
    a change of its `requires_grad` reaches its flat parameter."""


class ShardedDTensor(_TracksRequiresGrad, DTensor):
    """A parameter's view with the rows layout in a model with tensor-parallel parameters: a DTensor of the global
    parameter on the (dp, tp) mesh (replicated over tp for a parameter that is not tensor-parallel) whose
    `_local_tensor` is its row block inside the flat shard (`runtime/dtensor_views.py`). An `nn.Parameter`
    (`_is_param`); operations on it return plain DTensors. A change of its `requires_grad` reaches its flat
    parameter."""

    __slots__ = ()
    _is_param = True


# torch picks its foreach (and fused) kernels by exact type (`type(p) in _foreach_supported_types`), and registers
# DTensor there itself; without these two lines every optimizer (and any other caller of `_has_foreach_support` on the
# parameters) silently ran one kernel launch per tensor on a GPU (the small preset's AdamW step: 10.8 ms of host
# time on an H200, against 2.3 ms for the same model unsharded). The in-place foreach updates write the flat shard
# as the per-tensor ones do.
for _supported in (_optim_foreach_types, _util_foreach_types):
    _supported.extend(t for t in (ShardedParameter, ShardedDTensor) if t not in _supported)


def make_view(
    original: nn.Parameter, fqn: str, shard: torch.Tensor, spec: DTensorSpec | None = None
) -> ShardedParameter | ShardedDTensor:
    """The view that replaces `original` (empty until `bind_flat_shard` points it at the shard) and marks
    `original` as replaced, for `check_optimizer`. With `spec`: a `ShardedDTensor` with that spec."""
    empty = torch.empty(0, dtype=shard.dtype, device=shard.device)
    if spec is None:
        view = ShardedParameter(empty, original.requires_grad)
    else:
        view = ShardedDTensor(empty, spec, requires_grad=original.requires_grad)
    view.__dict__.update({k: v for k, v in original.__dict__.items() if not k.startswith("_")})
    view._fsdp_fqn = fqn
    original.__dict__[_REPLACED_BY] = fqn
    return view


def check_optimizer(optimizer: torch.optim.Optimizer, args=None, kwargs=None) -> None:
    """Raise if `optimizer` holds a parameter that fully_shard replaced (checked again when its count changes)."""
    if torch.compiler.is_compiling():
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if optimizer.__dict__.get(_CHECKED) == len(params):
        return
    replaced = [p.__dict__[_REPLACED_BY] for p in params if _REPLACED_BY in p.__dict__]
    if replaced:
        names = ", ".join(f"'{n}'" for n in replaced[:3]) + (
            f" and {len(replaced) - 3} more" if len(replaced) > 3 else ""
        )
        raise RuntimeError(
            f"fsdp_graph: {type(optimizer).__name__} holds parameter {names} as it was before fully_shard, which "
            "replaced it with a sharded one: it never gets a gradient, so this optimizer would train nothing. "
            "Build the optimizer after fully_shard, from model.parameters()."
        )
    optimizer.__dict__[_CHECKED] = len(params)


register_optimizer_step_pre_hook(check_optimizer)


def refuse_meta_parameters(flat_params, args: tuple) -> None:
    """A forward on real tensors while sharded parameters are still on the meta device (a model sharded on meta and
    never materialised) would fail inside some op with a device mismatch naming no parameter: refuse it first,
    naming them, as FSDP2 does. A forward whose inputs are all on meta (planning, shape tracing) is left alone.
    A parameter the user replaced after sharding (`module.w = nn.Parameter(...)`) is named as such: the gather reads
    the flat shard, never the new tensor (FSDP2 adopts it at its lazy init; docs/migrating-from-fsdp2.md)."""
    on_meta = [s for s in flat_params if s.flat_shard.device.type == "meta"]
    inputs = [a for a in args if isinstance(a, torch.Tensor)]
    if not on_meta or not inputs or all(a.device.type == "meta" for a in inputs):
        return
    names = [slot.fqns[0] for s in on_meta for slot in s.layout.slots]
    replaced = [
        f"{type(module).__name__}.{name}"
        for s in on_meta
        for view, owners in zip(s.views, s.owners)
        for module, name in owners
        if module._parameters.get(name) is not view
    ]
    if replaced:
        raise RuntimeError(
            f"fsdp_graph: {replaced} replaced a sharded parameter with a new nn.Parameter after fully_shard, while "
            f"its flat shard is still on the meta device (parameters {names}). A sharded parameter is a view of its "
            "unit's flat shard, which the forward reads, so the new tensor would never be used. Load the value "
            "instead: `module.load_state_dict({name: value}, strict=False, assign=True)`, or materialise the unit "
            "(`to_empty()`) and copy the value into the parameter under torch.no_grad()."
        )
    raise RuntimeError(
        f"fsdp_graph: these sharded parameters are still on the meta device: {names}. Materialise the model before "
        "a forward: `model.to_empty(device=...)`, then initialise it (e.g. `reset_parameters()` on each module), or "
        "load a checkpoint into it (`load_state_dict(..., assign=True)`, `set_model_state_dict`)."
    )
