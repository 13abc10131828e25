"""torch's `CommDebugMode` counts the eager path's collectives as it counts FSDP2's (issue 32).

CommDebugMode is a TorchDispatchMode: it counts the collectives dispatched while it is on the mode stack. FSDP2's
eager collectives are c10d ops (`dist.all_gather_into_tensor` dispatches `c10d._allgather_base_`,
`dist.reduce_scatter_tensor` `c10d._reduce_scatter_base_`, `dist.all_reduce` `c10d.allreduce_`), and code written for
FSDP2 (torch's own test_gradient_accumulation) reads the counts under those keys. fsdp_graph's collectives are
`_c10d_functional` ops inside the `fsdp::` ops' eager implementations, where the mode is off: it saw none.

So, while a CommDebugMode is the innermost mode: each collective an eager `fsdp::` op or the eager runtime issues
(`issue`) is recorded in it under FSDP2's c10d key, through the mode's own `__torch_dispatch__` (so its per-module
and forward/backward tables count it too), and the `_c10d_functional` op itself is kept from it (counted once).
The `fsdp::` ops reach `issue` with the mode through a dispatch rule (`torch.library.register_torch_dispatch`),
since torch runs a custom op's kernel with the mode popped.

What is counted is what runs: one all-gather per gather (two for `reshard_after_forward=k`'s forward: a piece, then
the pieces), one reduce-scatter per gradient reduction, one all-reduce per replica all-reduce (HSDP). On gloo the
reduce-scatter runs as an all-to-all and a local sum (gloo has none of its own; docs/design-notes.md): it is counted
as the reduce-scatter it implements, as gloo's own `reduce_scatter_tensor`, an all-reduce underneath, is under FSDP2.
Compiled graphs run `_c10d_functional` ops, which CommDebugMode counts under their own keys (as torch.compile'd
FSDP2's).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

_c10d = torch.ops.c10d
FSDP2_OPS = {  # what FSDP2's eager collectives dispatch
    "all_gather": _c10d._allgather_base_.default,
    "reduce_scatter": _c10d._reduce_scatter_base_.default,
    "all_reduce": _c10d.allreduce_.default,
}

# The CommDebugMode an `fsdp::` op was dispatched under, while its kernel runs (torch pops the mode meanwhile).
_counting_into: contextvars.ContextVar[CommDebugMode | None] = contextvars.ContextVar("fsdp_comm_debug", default=None)


class _Counted:
    """What CommDebugMode is handed for one fsdp_graph collective: FSDP2's op (name, overload packet), run as a no-op
    (the collective already ran)."""

    def __init__(self, op: torch._ops.OpOverload) -> None:
        self.op = op
        self._overloadpacket = op._overloadpacket

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __repr__(self) -> str:
        return str(self.op)


def issue(kind: str, collective: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """`collective(*args)` (a `_c10d_functional` op), counted as FSDP2's `kind` collective ("all_gather",
    "reduce_scatter", "all_reduce") by the CommDebugMode active here, if any."""
    mode = _counting_into.get()
    if mode is None:
        top = _get_current_dispatch_mode()
        if type(top) is not CommDebugMode:
            return collective(*args)
        with _pop_mode_temporarily() as mode:  # counted once, under FSDP2's key below
            result = collective(*args)
    else:
        result = collective(*args)
    mode.__torch_dispatch__(_Counted(FSDP2_OPS[kind]), (), (), {})
    return result


def count_inside(op: Any) -> None:
    """Make a CommDebugMode around a call of the custom op `op` count the collectives its kernel issues."""

    def rule(mode: CommDebugMode, func, types, args, kwargs):
        token = _counting_into.set(mode)
        try:
            return func(*args, **kwargs)
        finally:
            _counting_into.reset(token)

    torch.library.register_torch_dispatch(op, CommDebugMode, rule)
