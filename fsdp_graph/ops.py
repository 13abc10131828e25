"""The `fsdp` custom ops: the IR between the runtime and the passes (DESIGN §3).

Each op carries every sharding fact as an argument, so a pass needs no runtime lookup. The eager
implementations really communicate (through `_c10d_functional`, the same ops the lowering emits), so
the un-lowered graph, the eager path and the lowered graph all compute the same thing.
"""

from __future__ import annotations

import torch

_c10d = torch.ops._c10d_functional


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


@torch.library.custom_op("fsdp::unshard", mutates_args=())
def unshard(
    shard: torch.Tensor,
    unit: str,
    group: str,
    world: int,
    dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    replicate_group: str = "",
    replicate_world: int = 1,
) -> torch.Tensor:
    """The unit's full padded flat parameter: `shard` cast to `dtype`, then all-gathered over `group`
    (`world` == 1: nothing to gather, NO_SHARD).

    `reduce_dtype` is the dtype its gradient is reduced in (None: the gradient's own dtype);
    `reshard_after_forward` tells the reshard pass whether the backward re-gathers (True) or the forward
    saves the gathered tensor (False); `replicate_group`/`replicate_world` name the group the gradient is
    all-reduced over after the reduce-scatter (HYBRID_SHARD, NO_SHARD; 1: none).
    """
    cast = _cast(shard, dtype)
    if world == 1:
        return cast.clone() if cast is shard else cast
    return _c10d.wait_tensor(_c10d.all_gather_into_tensor(cast.contiguous(), world, group))


@unshard.register_fake
def _unshard_fake(
    shard,
    unit,
    group,
    world,
    dtype=None,
    reduce_dtype=None,
    reshard_after_forward=True,
    replicate_group="",
    replicate_world=1,
):
    return shard.new_empty(shard.numel() * world, dtype=dtype or shard.dtype)


@torch.library.custom_op("fsdp::reduce_grad", mutates_args=())
def reduce_grad(
    full_grad: torch.Tensor,
    unit: str,
    group: str,
    world: int,
    dtype: torch.dtype | None,
    out_dtype: torch.dtype,
    replicate_group: str = "",
    replicate_world: int = 1,
) -> torch.Tensor:
    """This rank's shard of the gradient averaged over all `world * replicate_world` data-parallel ranks:
    cast to `dtype`, reduce-scattered (sum) over `group`, all-reduced (sum) over `replicate_group`,
    divided, returned in `out_dtype`.

    Sum then a division: "avg" has no autograd formula and is not supported by every process-group backend.
    """
    grad = _cast(full_grad, dtype).contiguous()
    if world > 1:
        grad = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(grad, "sum", world, group))
    if replicate_world > 1:
        grad = _c10d.wait_tensor(_c10d.all_reduce(grad, "sum", replicate_group))
    return _cast(grad / (world * replicate_world), out_dtype)


@reduce_grad.register_fake
def _reduce_grad_fake(full_grad, unit, group, world, dtype, out_dtype, replicate_group="", replicate_world=1):
    return full_grad.new_empty(full_grad.numel() // world, dtype=out_dtype)


def _unshard_setup_context(ctx, inputs, output) -> None:
    shard, unit, group, world, _dtype, reduce_dtype, _reshard, replicate_group, replicate_world = inputs
    ctx.reduce_args = (unit, group, world, reduce_dtype, shard.dtype, replicate_group, replicate_world)


def _unshard_backward(ctx, grad: torch.Tensor):
    return (reduce_grad(grad, *ctx.reduce_args),) + (None,) * 8


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup_context)
