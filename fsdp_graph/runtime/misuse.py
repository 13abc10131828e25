"""Clear errors for two silent mistakes after `fully_shard` (issue 12):

- an optimizer built BEFORE `fully_shard` holds the original parameters, which no longer belong to the model:
  they never get a gradient and the optimizer trains nothing. `fully_shard` marks each replaced original, and a
  global optimizer step pre-hook refuses to step an optimizer holding one.
- `requires_grad` changed on a sharded parameter: a unit's trainable parameters share one flat shard (the frozen
  ones another), so one view cannot stop or start getting a gradient on its own. The views are `ShardedParameter`s
  (`ShardedDTensor`s in a model with tensor-parallel parameters, with the rows layout), which refuse the change
  when it is made.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.optim.optimizer import register_optimizer_step_pre_hook

_REPLACED_BY = "_fsdp_replaced_by"
_CHECKED = "_fsdp_checked_param_count"
_requires_grad = torch._C.TensorBase.requires_grad


class _FixedRequiresGrad:
    """Refuses a change of `requires_grad` (`_fsdp_fqn`: the parameter's name for the message)."""

    __slots__ = ()
    _fsdp_fqn: str = "?"

    @property
    def requires_grad(self) -> bool:
        return _requires_grad.__get__(self)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        self._check_requires_grad(value)
        _requires_grad.__set__(self, value)

    def requires_grad_(self, requires_grad: bool = True):
        self._check_requires_grad(requires_grad)
        return super().requires_grad_(requires_grad)

    def _check_requires_grad(self, value: bool) -> None:
        if bool(value) != _requires_grad.__get__(self):
            raise RuntimeError(
                f"fsdp_graph: requires_grad of parameter '{self._fsdp_fqn}' cannot change after fully_shard (it "
                "shares one flat shard with its unit's other "
                f"{'trainable' if not value else 'frozen'} parameters, so the change would be ignored). Set "
                "requires_grad before calling fully_shard: frozen parameters then get a flat shard of their own."
            )


class ShardedParameter(_FixedRequiresGrad, nn.Parameter):
    """A sharded parameter's view (this rank's piece of its unit's flat shard). Behaves as an `nn.Parameter`;
    changing its `requires_grad` raises, naming the parameter and the fix."""


class ShardedDTensor(_FixedRequiresGrad, DTensor):
    """A parameter's view with the rows layout in a model with tensor-parallel parameters: a DTensor of the global
    parameter on the (dp, tp) mesh (replicated over tp for a parameter that is not tensor-parallel) whose
    `_local_tensor` is its row block inside the flat shard (`runtime/dtensor_views.py`). An `nn.Parameter`
    (`_is_param`); operations on it return plain DTensors. Changing its `requires_grad` raises."""

    __slots__ = ()
    _is_param = True


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
