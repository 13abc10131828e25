"""The methods of `torch.distributed.fsdp.FSDPModule` on modules sharded through `fsdp_graph.fsdp2` (issue 28).

Every module a `fsdp_graph.fsdp2.fully_shard` call names gets a class deriving from torch's own `FSDPModule`, so
`isinstance(m, FSDPModule)` finds it as it finds FSDP2's modules (torchtitan's `disable_fsdp_gradient_division`
does). As in FSDP2, those methods come before the model's own in the class's MRO. Each method of torch 2.13's
`FSDPModule` either does what FSDP2's does, through the native engine's controls (`fsdp_graph.api.controls`), is a
documented no-op where it only tunes FSDP2's eager runtime (prefetch lists, CUDA events, communication buffers),
or raises NotImplementedError naming the method and why.

A module of a call holds `_fsdp2_unit` (the module holding the call's flat parameters: itself, or for a list call
the list's last module in model order) and `_fsdp2_root` (the module the engine ran on). A module whose call is
still pending (`fsdp_graph.fsdp2.calls`) shards the recorded calls first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from fsdp_graph.api import controls
from fsdp_graph.api.sync import set_requires_gradient_sync as set_model_gradient_sync

_FINAL_CLASSES: dict[type, type] = {}
# `calls.shard_pending`, registered by `calls` when it is imported (every FSDP2 module is made there): `calls` builds
# on this module's classes, so this module does not import it.
_SHARD_PENDING: list[Callable[[str, nn.Module], None]] = []


def on_pending_use(shard_pending: Callable[[str, nn.Module], None]) -> None:
    """Set what a method called on a module whose call is still pending runs first (`calls.shard_pending`)."""
    _SHARD_PENDING[:] = [shard_pending]


class FSDP2Module(TorchFSDPModule):
    """FSDP2's methods, on the native engine's units."""

    def __new__(cls, *args: Any, **kwargs: Any):
        # torch's FSDPModule.__new__ builds the original class (for container slicing); ours builds this class,
        # as the native engine's swapped classes do (object.__new__ takes no constructor arguments).
        return super(TorchFSDPModule, cls).__new__(cls)

    def _apply(self, *args: Any, **kwargs: Any):
        # Past torch's FSDPModule._apply (FSDP2's state) to the engine's `.to()` of flat shards, or nn.Module's.
        return super(TorchFSDPModule, self)._apply(*args, **kwargs)

    def _get_fsdp_state(self):
        raise NotImplementedError(
            "FSDPModule._get_fsdp_state: fsdp_graph has no FSDP2 runtime state (FSDPState, param groups); the "
            "units are compiled into the graph. Use the public FSDPModule methods."
        )

    def unshard(self, async_op: bool = False) -> controls.UnshardHandle | None:
        """Gather this module's unit now (not recursive, as FSDP2); see fsdp_graph.FSDPModule.unshard."""
        unit = _own_unit(self)
        if unit is None:
            return controls.UnshardHandle(self, []) if async_op else None
        return controls.FSDPModule.unshard(unit, async_op)

    def reshard(self) -> None:
        """Free what `unshard()` gathered for this module's unit (not recursive, as FSDP2)."""
        unit = _own_unit(self)
        if unit is not None:
            controls.FSDPModule.reshard(unit)

    def reset_iter_state(self) -> None:
        """After a forward or backward that raised: end the eager forward it left open (gathers, hooks)."""
        from fsdp_graph.runtime import eager_reshard

        root = _root_state(self)
        if root is None:
            return
        root.forward_depth = 0
        root.gathered.clear()
        root.recompute = None
        if root.saved_hooks is not None:
            eager_reshard.end(root.saved_hooks)
        root.session = root.saved_hooks = None

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """A no-op: every backward's reductions finish inside that backward (FSDP2 uses this flag to decide
        whether to wait for them at the end of the backward)."""
        _check_bool("set_is_last_backward", is_last_backward)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: the next backwards accumulate unreduced gradients without communicating; True: the next one
        reduces them all (`fsdp_graph.set_requires_gradient_sync`). The engine has one switch for the model, so
        this must cover all its units: called on the root with recurse=True (or on a module holding every unit)."""
        _check_bool("set_requires_gradient_sync", requires_gradient_sync)
        root_module = _root_module(self)
        chosen = {id(u) for u in _units(self, recurse)}
        every = {id(u) for u in _units(root_module, True)}
        if not every <= chosen:
            raise NotImplementedError(
                f"FSDPModule.set_requires_gradient_sync on {type(self).__name__} (recurse={recurse}) covers only "
                "some units: fsdp_graph switches gradient sync for the whole model (one compiled graph per setting). "
                "Call it on the root module, which fully_shard was called on last, with recurse=True."
            )
        set_model_gradient_sync(root_module, requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False skips the all-reduce across replicas (see fsdp_graph.FSDPModule.set_requires_all_reduce)."""
        _check_bool("set_requires_all_reduce", requires_all_reduce)
        for unit in _units(self, recurse):
            controls.FSDPModule.set_requires_all_reduce(unit, requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether the units free their gathered parameters after forward (the backward gathers again). Taken by
        the next forward. An int setting from fully_shard becomes the bool."""
        _check_bool("set_reshard_after_forward", reshard_after_forward)
        for unit in _units(self, recurse):
            for state in controls._states(unit, "set_reshard_after_forward"):
                state.reshard_after_forward = reshard_after_forward
                state.post_forward_world, state.post_forward_group, state.piece_group = 1, "", ""

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False keeps the units' gathered parameters after backward (see
        fsdp_graph.FSDPModule.set_reshard_after_backward)."""
        _check_bool("set_reshard_after_backward", reshard_after_backward)
        for unit in _units(self, recurse):
            controls.FSDPModule.set_reshard_after_backward(unit, reshard_after_backward, recurse=False)

    def set_modules_to_forward_prefetch(self, modules: list[TorchFSDPModule]) -> None:
        """A no-op: the compiled graph's schedule places every gather (fsdp_graph's prefetch), not a list."""
        _check_modules("set_modules_to_forward_prefetch", modules)

    def set_modules_to_backward_prefetch(self, modules: list[TorchFSDPModule]) -> None:
        """A no-op: the compiled graph's schedule places every gather (fsdp_graph's prefetch), not a list."""
        _check_modules("set_modules_to_backward_prefetch", modules)

    def set_custom_all_gather(self, comm: Any) -> None:
        _not_built("set_custom_all_gather", "the all-gathers are graph ops lowered and bucketed by fsdp_graph's passes")

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        _not_built("set_custom_reduce_scatter", "the reductions are graph ops lowered by fsdp_graph's passes")

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        _not_built("set_all_reduce_hook", "the reduced gradient is a value inside the compiled backward")

    def set_post_optim_event(self, event: torch.Event) -> None:
        """A no-op: FSDP2 waits on this CUDA event before the next forward's all-gathers; fsdp_graph's gathers are
        ordered after the optimizer step by the stream they run on."""

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's older name of `set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's unit's reduced gradients by `factor` instead of the data-parallel size (not
        recursive, as FSDP2); 1.0 sums them."""
        unit = _own_unit(self)
        if unit is not None:
            controls.FSDPModule.set_gradient_divide_factor(unit, factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """A no-op: fsdp_graph's reductions always communicate a SUM and divide locally (no PREMUL_SUM or AVG)."""
        _check_bool("set_force_sum_reduction_for_comms", enable)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """A no-op: a unit's gradient is reduced as one flat tensor, unused parameters' zeros included."""
        _check_bool("set_reduce_scatter_unused_params", reduce_scatter_unused_params)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """A no-op: FSDP2's eager runtime bounds its reduce-scatter input buffers; the compiled backward's buffers
        are planned with the graph (at most two full gradients in reduction, passes/schedule.py)."""

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """A no-op after sharding: the native `fully_shard(separate_reduce_group=True)` chooses this at shard time."""

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """A no-op: the backward gathers a unit's parameters only where its gradient computation reads them."""
        _check_bool("set_unshard_in_backward", unshard_in_backward)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """A no-op: communication buffers come from the compiled graph's allocator."""

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """A no-op: symmetric-memory collectives are not used; the collectives stay NCCL's (or gloo's)."""

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """A no-op: the compiled graph issues every gather asynchronously."""


def fsdp2_class(cls: type) -> type:
    """`cls` (the engine's swapped class, or a pending module's original) with FSDP2's methods first."""
    if issubclass(cls, FSDP2Module):
        return cls
    if cls not in _FINAL_CLASSES:
        original = getattr(cls, "_fsdp_original_class", cls)
        _FINAL_CLASSES[cls] = type(f"FSDP{original.__name__}", (FSDP2Module, cls), {})
    return _FINAL_CLASSES[cls]


def _own_unit(module: nn.Module) -> nn.Module | None:
    """The unit module holding `module`'s call's flat parameters, or None when that call sharded nothing."""
    _ensure_sharded(module)
    unit = module.__dict__["_fsdp2_unit"]
    return unit if unit.__dict__.get("_fsdp_states") else None


def _units(module: nn.Module, recurse: bool) -> list[nn.Module]:
    """The unit modules of the calls on `module` (recurse: and on every module below it), each once."""
    _ensure_sharded(module)
    found: dict[int, nn.Module] = {}
    for m in module.modules() if recurse else [module]:
        unit = m.__dict__.get("_fsdp2_unit")
        if unit is not None and unit.__dict__.get("_fsdp_states"):
            found.setdefault(id(unit), unit)
    return list(found.values())


def _root_module(module: nn.Module) -> nn.Module:
    _ensure_sharded(module)
    return module.__dict__["_fsdp2_root"]


def _root_state(module: nn.Module):
    return _root_module(module).__dict__.get("_fsdp_root")


def _ensure_sharded(module: nn.Module) -> None:
    if "_fsdp2_unit" not in module.__dict__:
        for shard_pending in _SHARD_PENDING:
            shard_pending(f"{type(module).__name__}'s FSDPModule method", module)


def _check_bool(method: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"FSDPModule.{method}: expected a bool, got {value!r}")


def _check_modules(method: str, modules: list) -> None:
    for m in modules:
        if not isinstance(m, TorchFSDPModule):
            raise ValueError(f"FSDPModule.{method}: {type(m).__name__} is not a module fully_shard was called on.")


def _not_built(method: str, why: str) -> None:
    raise NotImplementedError(f"FSDPModule.{method} is not supported by fsdp_graph: {why}.")
