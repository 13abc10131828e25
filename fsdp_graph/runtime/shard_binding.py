"""Binding a flat shard: the original parameters become views of their ranges of it. Below `unit`, which binds
the shards it makes, and `owner_apply`, which binds the ones a module's own conversion allocates, so that neither
imports the other."""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_graph.runtime.dtensor_views import set_local
from fsdp_graph.runtime.misuse import REQUIRES_GRAD_CHANGED
from fsdp_graph.runtime.param_changes import ensure_grad_hook, sync_requires_grad

if TYPE_CHECKING:
    from fsdp_graph.runtime.unit import FlatParamState


def bind_flat_shard(state: FlatParamState, flat_shard: torch.Tensor) -> None:
    """Make `flat_shard` the storage of `state`: every original-parameter view is re-pointed at its range (the
    Parameter objects stay the same, so optimizers keep working) and the gradient hook moves with it."""
    layout = state.layout
    base = flat_shard.detach()
    for view, slot in zip(state.views, layout.slots):
        if isinstance(view, DTensor):
            set_local(view, layout.local_view(base, slot))
        else:
            _point(view, layout.local_view(base, slot))
        view.__dict__[REQUIRES_GRAD_CHANGED] = functools.partial(_sync_if_alive, weakref.ref(state))
    # A flat shard's size never changes. Without this, compiling a second model of the same class in one process
    # (other sizes) makes Dynamo's automatic-dynamic mark the shards dynamic: symbolic collective sizes, which the
    # passes then cannot bucket, convert or schedule by size.
    torch._dynamo.mark_static(flat_shard)
    shards = state.module.__dict__.setdefault("_fsdp_flat_shards", [])
    if state.index == len(shards):
        shards.append(flat_shard)
    else:
        shards[state.index] = flat_shard
    ensure_grad_hook(state)


def _sync_if_alive(state_ref: weakref.ref[FlatParamState], view: nn.Parameter) -> None:
    state = state_ref()
    if state is not None:
        sync_requires_grad(state, view)


def _point(view: nn.Parameter, local: torch.Tensor) -> None:
    """Make `local` the data of `view`, which stays the same Python object (what optimizers and modules hold)."""
    if torch._has_compatible_shallow_copy_type(view, local):
        view.data = local
        return
    # Another device type (a meta-device model's `to_empty()`): `.data` cannot change it, a swap can.
    attributes = dict(view.__dict__)
    torch.utils.swap_tensors(view, type(view)(local, view.requires_grad))
    view.__dict__.update(attributes)
