"""Gathers kept past a step (`set_reshard_after_backward(False)`, issue 12): `RootState.held`, what makes one stale
(a changed shard object or version; compiled: an optimizer step), and when they are dropped."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

if TYPE_CHECKING:
    from fsdp_graph.runtime.unit import FlatParamState, RootState


@dataclass(eq=False)
class HeldGather:
    """A unit's gathered flat parameter kept for its next forward (`set_reshard_after_backward(False)`), with what
    its shard was when it was gathered: a different shard object or version means it is stale."""

    flat: torch.Tensor  # detached: the next forward links it to the shard anew
    shard: weakref.ref | None = None  # eager: checked by the next forward (compiled: `track_kept_gathers`)
    version: int = 0



def keeps(state: FlatParamState) -> bool:
    """Whether `state`'s unit keeps its gathered flat parameter after backward (`set_reshard_after_backward(False)`)."""
    return not state.reshard_after_backward and state.world > 1


def _shard_version(state: FlatParamState) -> int:
    # The optimizer writes the parameter views, whose version counters are their own, not the flat shard's.
    return state.flat_shard._version + sum(view._version for view in state.views)


def hold(state: FlatParamState, flat: torch.Tensor) -> None:
    state.root.held[state.name] = HeldGather(flat.detach(), weakref.ref(state.flat_shard), _shard_version(state))


def valid_held(state: FlatParamState) -> HeldGather | None:
    """The kept gather of `state`, if its shard has not changed since (an optimizer step, a load_state_dict, a
    `.to()`): a stale one is dropped, so the caller gathers the current values."""
    held = state.root.held.get(state.name)
    if held is None:
        return None
    if held.shard is not None and (held.shard() is not state.flat_shard or held.version != _shard_version(state)):
        del state.root.held[state.name]
        return None
    return held


def drop_held(state: FlatParamState) -> None:
    """Free the gather `set_reshard_after_backward(False)` kept for `state` (`FSDPModule.reshard`, a load)."""
    state.root.held.pop(state.name, None)


_ROOTS_KEEPING: weakref.WeakSet[RootState] = weakref.WeakSet()
_STEP_HOOK: list = []  # the global optimizer post-step hook's handle, registered once


def track_kept_gathers(root: RootState) -> None:
    """Drop `root`'s kept gathers whenever an optimizer steps their parameters. A compiled forward cannot check
    the shard's version before choosing its graph (Dynamo guards on whether a gather is kept, not on versions), so
    stale gathers are dropped when the shard changes: after any optimizer step (a global post-step hook, also
    optimizer-in-backward's), a `load_state_dict`, a `.to()`, or `reshard()`."""
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_post_hook(_drop_stepped))
    _ROOTS_KEEPING.add(root)


def _drop_stepped(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    roots = [root for root in _ROOTS_KEEPING if root.held]
    if not roots:
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for root in roots:
        for state in root.flat_params:
            if state.name in root.held and any(id(view) in stepped for view in state.views):
                drop_held(state)
