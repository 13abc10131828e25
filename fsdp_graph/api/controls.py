"""FSDP2's per-module controls on sharded unit modules (issue 12): every unit module's class derives from
`FSDPModule`, so `isinstance(m, FSDPModule)` finds them and `m.unshard()`, `m.set_gradient_divide_factor(...)`
work as on `torch.distributed.fsdp.FSDPModule`. `register_fsdp_forward_method` makes another method gather as
`forward` does.

A control that changes the graph's collectives travels as an `fsdp::unshard` argument read from the unit's state:
under torch.compile, Dynamo guards on it, so a new setting compiles one more graph once (not one per step).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn

from fsdp_graph.ir import ops
from fsdp_graph.runtime.held import drop_held
from fsdp_graph.runtime.unit import enter_forward, exit_forward


@dataclass
class UnshardHandle:
    """`FSDPModule.unshard(async_op=True)`'s result: `wait()` finishes the gathers and exposes the full
    parameters (a no-op once done)."""

    module: nn.Module
    started: list[tuple[object, torch.Tensor]]  # (FlatParamState, its gather in flight)

    def wait(self) -> None:
        for state, started in self.started:
            state.root.unsharded[state.name] = ops.wait_gather(started, state.world)
        self.started = []


class FSDPModule:
    """Methods of every sharded unit module (the model's own methods of the same name take precedence)."""

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this unit's parameters now (collective: every rank of its group must call it). Until
        `reshard()`, reading them outside forward (`module.weight`) gives the full tensors, in the compute
        dtype (MixedPrecision.param_dtype) and on the compute device: e.g. to copy weights to an inference engine
        one unit at a time. Read-only: writes to them are not copied back to the shards (see
        `summon_full_params` for that). Forwards still gather as usual. `async_op=True`: returns a handle whose
        `wait()` completes the gathers; without it, returns None once they are done."""
        started = []
        with torch.no_grad():
            for state in _states(self, "unshard"):
                shard = state.flat_shard.detach()
                started.append(
                    (
                        state,
                        ops.start_gather(shard, state.group_name, state.world, state.param_dtype, state.compute_device),
                    )
                )
        handle = UnshardHandle(self, started)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the full parameters `unshard()` gathered (outside forward, parameters read as shards again) and the
        ones a backward kept under `set_reshard_after_backward(False)` (the next forward gathers again)."""
        for state in _states(self, "reshard"):
            state.root.unsharded.pop(state.name, None)
            drop_held(state)
            if state.root.exposure is not None:
                state.root.exposure.restore([state])

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False: a unit's backward keeps its gathered parameters, so its next forward gathers nothing (gradient
        accumulation: memory for communication). A unit that reshards after forward still frees them after that
        forward and gathers in its backward, as FSDP2 does. `recurse`: every unit in this module's subtree, else
        this unit only. True again stops keeping: the next forward still uses (and frees) what is kept, so the
        FSDP2 idiom `set_reshard_after_backward(is_last_microbatch)` before each forward saves a gather in the last
        one too; `reshard()` frees kept parameters at once.

        If the shard changes while kept (an optimizer step, load_state_dict, `.to()`), the next forward gathers the
        new values (FSDP2 would use the stale ones); writes through `param.data` are not seen, so call `reshard()`
        after them. Compiled, the forward's gather is kept (the backward gathers nothing either), and each setting
        compiles once (docs/design-notes.md)."""
        if not isinstance(reshard_after_backward, bool):
            raise TypeError(
                f"set_reshard_after_backward: reshard_after_backward must be a bool, got {reshard_after_backward!r}"
            )
        modules = [m for m in self.modules() if m.__dict__.get("_fsdp_states")] if recurse else [self]
        states = [state for module in modules or [self] for state in _states(module, "set_reshard_after_backward")]
        for state in states:
            state.reshard_after_backward = reshard_after_backward

    def set_gradient_divide_factor(self, factor: float | None) -> None:
        """Divide this unit's reduced gradients by `factor` instead of the data-parallel size (None: back to the
        mean); e.g. 1.0 sums them. Taken by the next forward; compiled, each new factor compiles once."""
        if factor is not None and not (isinstance(factor, int | float) and factor > 0):
            raise ValueError(f"set_gradient_divide_factor: factor must be a positive number or None, got {factor!r}")
        for state in _states(self, "set_gradient_divide_factor"):
            state.divide_factor = None if factor is None else float(factor)

    def set_requires_all_reduce(self, requires_all_reduce: bool) -> None:
        """HYBRID strategies: False skips the all-reduce across replicas in the next backwards; each adds its
        reduce-scattered sum to a shard-size partial sum instead (`.grad` is untouched). The first backward with it
        True again adds the partial sum before its all-reduce, so the gradients equal reducing every backward
        (FSDP2's semantics). No effect without replicas. Compiled: one graph per setting, compiled once. Under CPU
        offload the partial sum lives on the compute device (one shard per unit)."""
        for state in _states(self, "set_requires_all_reduce"):
            if not requires_all_reduce and state.partial is None and state.flat_shard.requires_grad:
                _add_partial(state)
            elif not requires_all_reduce and state.partial is not None:
                ops.register_accumulator(state.partial)  # (again: a deep copy of the model has leaves of its own)
            state.requires_all_reduce = bool(requires_all_reduce)


def _add_partial(state) -> None:
    shard = state.flat_shard
    # An expanded scalar (as no_sync's accumulator): only its `.grad` takes memory, one shard's worth. On the device
    # the gradients are reduced on (CPU offload: the compute device, as no_sync's): a host partial sum would take
    # asynchronous copies autograd adds into at once, and the all-reduce graph would add a host tensor on the device.
    device = state.compute_device or shard.device
    leaf = torch.zeros((), dtype=shard.dtype, device=device).expand(shard.numel())
    state.partial = leaf.requires_grad_()
    torch._dynamo.mark_static(leaf)
    ops.register_accumulator(leaf)


def _states(module: nn.Module, method: str) -> list:
    states = module.__dict__.get("_fsdp_states")
    if not states:
        raise RuntimeError(
            f"{method}: {type(module).__name__} is not a sharded unit (it owns no flat parameter); call it on a "
            "module fully_shard made a unit (the wrap policy's modules, or the root)."
        )
    if any(state.root.forward_depth for state in states):
        raise RuntimeError(f"{method}: not allowed inside forward; call it between steps.")
    return states


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make `module.<method_name>(...)` (e.g. `generate`) see full parameters, as `forward` does: inside it,
    parameter reads gather (once per unit per call; FULL_SHARD units are freed after it). Called eagerly;
    `module` is the sharded model or one of its modules."""
    root = _root_of(module)
    method = getattr(module, method_name, None)
    if not callable(method):
        raise AttributeError(f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}")
    own_states = module.__dict__.get("_fsdp_states", [])

    @functools.wraps(method)
    def gathering(*args, **kwargs):
        enter_forward(root)
        try:
            return method(*args, **kwargs)
        finally:
            exit_forward(root, own_states)

    module.__dict__[method_name] = gathering


def _root_of(module: nn.Module):
    if "_fsdp_root" in module.__dict__:
        return module.__dict__["_fsdp_root"]
    if module.__dict__.get("_fsdp_states"):
        return module._fsdp_states[0].root
    views = module.__dict__.get("_fsdp_views")
    if views:
        spec = next(iter(views.values()))
        return spec.unit._fsdp_states[spec.index].root
    raise ValueError(
        f"register_fsdp_forward_method: {type(module).__name__} is not part of a sharded model; call "
        "fsdp_graph.fully_shard on the model first, then register its modules' methods."
    )
