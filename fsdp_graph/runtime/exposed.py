"""FSDP2's registered parameters after an eager forward (issue 32, `fsdp_graph.fsdp2` only).

Under FSDP2 a unit that does not reshard after forward keeps its unsharded parameters registered on its modules
from its forward until its backward (or `reshard()`): `model.parameters()` and `module.weight` are then plain
tensors of the full shape, not the sharded DTensors. fsdp_graph's units keep their sharded views registered (what
optimizers hold) and gather inside forward; with `UnshardedParams` on the root state (set by `fsdp_graph.fsdp2`),
the outermost eager forward's end registers, for each flat parameter it gathered and did not free (reshard after
forward off), the parameters the forward read (detached, so no copy) as `nn.Parameter`s in every module using
them, and puts the views back:
- at the end of a backward through one of those gathers (unless the unit keeps its gathers after backward,
  `set_reshard_after_backward(False)`, as FSDP2 keeps its unsharded parameters then);
- at `reshard()`, and before a state dict is saved or loaded or the model is moved (`.to()`), as FSDP2's own hooks
  reshard then.
Compiled forwards register nothing (the graph's gathers are not Python values between steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from fsdp_graph.runtime.unit import FlatParamState


@dataclass(eq=False)
class _Registered:
    state: FlatParamState
    swaps: list[tuple[nn.Module, str, nn.Parameter]]  # (module, name, the sharded view to put back)


@dataclass(eq=False)
class UnshardedParams:
    """One `fully_shard` call's parameters registered unsharded after forward (held by its `RootState`)."""

    reads: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)  # this forward's reads, by (name, slot)
    registered: dict[str, _Registered] = field(default_factory=dict)  # by flat parameter name
    callback_queued: bool = False

    def record_read(self, state: FlatParamState, slot: int, value: torch.Tensor) -> None:
        self.reads[(state.name, slot)] = value

    def register(self, gathered: dict[str, torch.Tensor], states: list[FlatParamState]) -> None:
        """The outermost forward ends: register the unsharded parameters of every flat parameter in `gathered`
        (what it gathered and kept) that does not reshard after forward."""
        reads, self.reads = self.reads, {}
        for state in states:
            flat = gathered.get(state.name)
            if flat is None or (state.reshard_after_forward and state.world > 1):
                continue
            self.restore([state])
            swaps = []
            for slot, (view, owners) in enumerate(zip(state.views, state.owners)):
                value = reads.get((state.name, slot))
                if value is None:  # a parameter this forward did not read
                    value = state.layout.param_of(flat, state.layout.slots[slot])
                if state.tp and state.tp[slot] is not None:  # the tensor-parallel DTensor the forward saw
                    value = state.tp[slot].wrap(value)
                param = nn.Parameter(value.detach(), requires_grad=view.requires_grad)
                for module, name in owners:
                    module._parameters[name] = param
                    swaps.append((module, name, view))
            self.registered[state.name] = _Registered(state, swaps)
            if flat.requires_grad:
                flat.register_hook(self._after_backward)

    def restore(self, states: list[FlatParamState]) -> None:
        """Put the sharded views of `states` back in place of their registered unsharded parameters. A
        `requires_grad_()` the user applied to a registered parameter (FSDP2's `module.parameters()` then) carries
        over to its view: a frozen unit whose forward kept its gathers has no backward to restore it, so its
        parameters stay registered until its next forward, and unfreezing them in between must unfreeze the view."""
        for state in states:
            entry = self.registered.pop(state.name, None)
            for module, name, view in entry.swaps if entry is not None else ():
                registered = module._parameters.get(name)
                if registered is not None and registered is not view and registered.requires_grad != view.requires_grad:
                    view.requires_grad_(registered.requires_grad)
                module._parameters[name] = view

    def restore_all(self) -> None:
        self.restore([entry.state for entry in list(self.registered.values())])

    def _after_backward(self, grad: torch.Tensor) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self.callback_queued = False
        self.restore([e.state for e in list(self.registered.values()) if e.state.reshard_after_backward])
