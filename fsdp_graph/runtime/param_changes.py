"""A sharded parameter's `requires_grad` changed after `fully_shard` (FSDP2 allows it: fine-tuning freezes and
unfreezes after wrapping; docs/design-notes.md, "requires_grad changes after sharding: a mask, not a new layout").

The flat layout stays as `fully_shard` made it (a unit's parameters that were trainable then in one flat shard, its
frozen ones in `<unit>[frozen]`). Each view reports a change to its flat parameter (`misuse.ShardedParameter`),
which then:
- requires grad while any of its views does: a shard whose views are all frozen computes, reduces and stores no
  gradient, and one that was frozen at `fully_shard` gets its gradient hook when a view is unfrozen;
- reads its frozen views detached in forward (`detached_slots`), so autograd computes no gradient for them, and the
  gradient hook hands them none. The backward still reduces the shard's whole gradient, zeros where the detached
  views are: that is the cost of a change that splits a flat shard.
Compiled graphs are specialised on both: the shard's flag by Dynamo's guard on the graph input, `detached_slots` by
its guard on the constant the gather reads (`unit._compiled_gather`), for every unit, also those whose forward is a
stamped-out block-reuse body; a unit's block key is computed again, so it shares a body only with units frozen alike.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch.nn as nn

from fsdp_graph.runtime import offload
from fsdp_graph.runtime.block_key import BLOCK_KEY, block_key
from fsdp_graph.runtime.grads import install_grad_hook

if TYPE_CHECKING:
    from fsdp_graph.runtime.unit import FlatParamState


def ensure_grad_hook(state: FlatParamState) -> None:
    """Install the gradient hook on the flat shard if it requires grad and has none yet."""
    flat_shard = state.flat_shard
    if not flat_shard.requires_grad or (state.hooked is not None and state.hooked() is flat_shard):
        return
    # CPU offload from an accelerator: the gradient arrives by an asynchronous device-to-host copy.
    fence = None
    if offload.is_accelerator(state.compute_device) and flat_shard.device.type == "cpu":
        fence = (state.root.grad_fence, state.compute_device)
    install_grad_hook(flat_shard, state.views, state.layout, state.after_grad, state.grad_dtype, fence)
    state.hooked = weakref.ref(flat_shard)


def sync_requires_grad(state: FlatParamState, view: nn.Parameter | None = None) -> None:
    """Bring `state`'s flat shard, `detached_slots` and block key in line with its views' `requires_grad` (called by
    a view whose flag changed). A gather kept across steps (`set_reshard_after_backward(False)`) was made with the
    old flags, so it is dropped."""
    wanted = [v.requires_grad for v in state.views]
    trainable = any(wanted)
    shard = state.flat_shard
    if shard.requires_grad != trainable:
        shard.requires_grad_(trainable)
    state.detached_slots = tuple(i for i, w in enumerate(wanted) if not w) if trainable else ()
    ensure_grad_hook(state)
    state.root.held.pop(state.name, None)
    if BLOCK_KEY in state.module.__dict__:
        state.module.__dict__[BLOCK_KEY] = block_key(state.module)
