"""Gradients of original parameters as views of the reduced flat-shard gradient (DESIGN §2)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_graph.runtime import grad_presence
from fsdp_graph.runtime.dtensor_views import like, local_of, set_local
from fsdp_graph.runtime.flat_param import Layout
from fsdp_graph.runtime.offload import GradFence


def install_grad_hook(
    flat_shard: torch.Tensor,
    views: list[nn.Parameter],
    layout: Layout,
    after: list[Callable[[], None]],
    grad_dtype: torch.dtype | None = None,
    fence: tuple[GradFence, torch.device] | None = None,
) -> None:
    """After each backward, hand every original parameter its piece of `flat_shard.grad` (`layout.local_view`:
    the same shape as the parameter view).

    Plain PyTorch semantics: `.grad is None` (after `zero_grad()`) -> becomes a view of this backward's
    reduced gradient; otherwise the new gradient is added in place (accumulation). A parameter no read of which got
    a gradient in this backward (`grad_presence`), here or on another rank (its reduced piece is not all zero), is
    skipped: its `.grad` stays as it was, None after `zero_grad()`, as FSDP2's. The flat shard's own
    `.grad` is dropped so a later backward never accumulates into a gradient the user already zeroed.
    Then every callback in `after` runs (e.g. an optimizer step in backward); it is read at call time, so
    callbacks added later count. Each parameter's own post-accumulate-grad hooks (what a user registered on it with
    `register_post_accumulate_grad_hook`: autograd never accumulates into the views, so it never calls them) run
    right after that parameter's `.grad` is in place, once per backward that reduces the gradient (none while sync
    or the replica all-reduce is off: the shard gets no gradient then), as FSDP2 runs them. `grad_dtype` (MixedPrecision.keep_low_precision_grads): gradients are
    stored in that dtype; autograd cannot hand an fp32 leaf a bf16 gradient, so, as FSDP1 does, the
    low-precision tensor is installed through `.grad.data`. `fence` (CPU offload from an accelerator: the
    gradient was copied from that device asynchronously): everything after taking the gradient waits for the copy
    at the end of the backward (`GradFence`). A DTensor view (every view of a model with tensor-parallel parameters,
    with the rows layout: `dtensor_views`) gets a DTensor gradient with its spec around the piece; accumulation adds
    into that gradient's local tensor.
    """

    def hook(flat: torch.Tensor) -> None:
        grad = flat.grad
        flat.grad = None
        if grad is None:
            return
        reads = grad_presence.take(flat)
        reached = None if reads is None or None in reads else {layout.slot_at(p) for p in reads}
        if fence is not None:
            fence[0].defer(fence[1], lambda: hand_out(grad, reached))
        else:
            hand_out(grad, reached)

    def hand_out(grad: torch.Tensor, reached: set[int | None] | None) -> None:
        for index, (param, slot) in enumerate(zip(views, layout.slots)):
            if not param.requires_grad:
                continue
            piece = layout.local_view(grad, slot)
            if reached is not None and index not in reached and not piece.any():
                continue  # no gradient reached it here, nor (the reduced piece is zero) on another rank: as FSDP2
            if grad_dtype is not None:
                piece = piece.to(grad_dtype)
            if param.grad is not None:
                local_of(param.grad).add_(piece)
            elif grad_dtype is not None:
                param.grad = torch.empty_like(param)
                if isinstance(param.grad, DTensor):
                    set_local(param.grad, piece)
                else:
                    param.grad.data = piece
            else:
                param.grad = like(piece, param)
            _run_post_accumulate_grad_hooks(param)
        for callback in after:
            callback()

    flat_shard.register_post_accumulate_grad_hook(hook)


def _run_post_accumulate_grad_hooks(param: nn.Parameter) -> None:
    """`register_post_accumulate_grad_hook`'s hooks of `param`, in registration order, with `param` (its `.grad`
    now holds the reduced gradient shard, added to what was there)."""
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    for hook in list(hooks.values()) if hooks else ():
        hook(param)
