"""The `fsdp` custom ops: the IR between the runtime and the passes (DESIGN §3).

Each op carries every sharding fact as an argument, so a pass needs no runtime lookup. The eager
implementations really communicate (through `_c10d_functional`, the same ops the lowering emits), so
the un-lowered graph, the eager path and the lowered graph all compute the same thing.
"""

from __future__ import annotations

import math
import weakref
from collections import namedtuple
from typing import Any

import torch

from fsdp_graph.ir.comm_debug import count_inside, issue

_c10d = torch.ops._c10d_functional


def is_gloo_group(group: str, device: torch.device | str = "cpu") -> bool:
    """Whether `group` runs collectives on `device`'s tensors with gloo (a mixed `cpu:gloo,cuda:nccl` group does for
    CPU tensors only; fully_shard's single-thread copies of gloo groups, `fsdp_graph.runtime.gloo`, count). gloo has no
    native reduce-scatter (it runs one as a full all-reduce): such groups reduce by all-to-all."""
    import torch.distributed as dist

    from fsdp_graph.runtime.devices import backend_for
    from fsdp_graph.runtime.gloo import GLOO_BACKENDS

    return backend_for(dist.distributed_c10d._resolve_process_group(group), device) in GLOO_BACKENDS


def gradient_divide_factors(data_parallel_size: int, divide_factor: float | None = None) -> tuple[int, int | float]:
    """(pre, post): a gradient is divided by `pre` before its reduction and by `post` after it, pre * post ==
    `divide_factor` (None: `data_parallel_size`, so the result is the mean; `set_gradient_divide_factor` sets
    another, e.g. 1.0 for a plain sum). The one definition the eager op and `passes.lower` share.

    A plain sum grows with the world: at 512 ranks a bf16/fp16 sum overflows fp16's range or rounds away the
    small terms, and dividing only afterwards cannot recover them. Splitting the division keeps every partial
    sum within about sqrt(world) times one gradient. `pre` is the smallest power of two not below sqrt(total):
    dividing by a power of two is exact in binary floating point (short of underflow), so an fp32 reduction
    gives bit for bit the sum-then-divide result, and the parity tests keep their precision."""
    if data_parallel_size < 1:
        raise ValueError(f"gradient_divide_factors: data_parallel_size must be >= 1, got {data_parallel_size}")
    if divide_factor is not None and not divide_factor > 0:
        raise ValueError(f"gradient_divide_factors: divide_factor must be > 0, got {divide_factor}")
    total = data_parallel_size if divide_factor is None else divide_factor
    pre = 1 << ((max(math.ceil(total), 1) - 1).bit_length() + 1) // 2
    post = total // pre if isinstance(total, int) and total % pre == 0 else total / pre
    return pre, post


class OpSignature:
    """The argument list of a registered op, read from its schema: the op's Python definition below is the one
    place an argument is declared; the fake, the autograd formula, the runtime's call and the passes (through
    `fsdp_graph.ir`) all derive names, defaults and arity from here."""

    def __init__(self, op: torch._ops.OpOverload):
        arguments = op._schema.arguments
        self.names: tuple[str, ...] = tuple(a.name for a in arguments)
        self.defaults: dict[str, Any] = {a.name: a.default_value for a in arguments if a.has_default_value()}
        self.Args = namedtuple(f"{op._schema.name.split('::')[-1]}_args", self.names)

    @property
    def arity(self) -> int:
        return len(self.names)

    def bind(self, args: tuple | list, kwargs: dict[str, Any]) -> Any:
        """The call's arguments by name (an `Args` namedtuple), defaults filled in."""
        values = dict(self.defaults)
        values.update(zip(self.names, args))
        values.update(kwargs)
        return self.Args(**values)

    def call_args(self, values: dict[str, Any]) -> tuple:
        """Positional arguments for a call with `values` (by name): up to the last one that differs from its
        default, so a graph shows only the facts that matter (no `no_sync` arguments for a model without it)."""
        unknown = set(values) - set(self.names)
        if unknown:
            raise TypeError(f"unknown op arguments {sorted(unknown)}; the op takes {self.names}")
        full = [values[n] if n in values else self.defaults[n] for n in self.names]
        end = len(full)
        while end and self.names[end - 1] in self.defaults and _same(full[end - 1], self.defaults[self.names[end - 1]]):
            end -= 1
        return tuple(full[:end])

    def gradients(self, **grads: torch.Tensor | None) -> tuple:
        """An autograd formula's return value: `grads` by input name, None for every other input."""
        return tuple(grads.get(n) for n in self.names)


def _same(value: Any, default: Any) -> bool:
    return value is default or (type(value) is type(default) and value == default)


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
    sync: bool = True,
    unsynced: torch.Tensor | None = None,
    compute_device: torch.device | None = None,
    reduce_group: str = "",
    divide_factor: float | None = None,
    all_reduce: bool = True,
    partial: torch.Tensor | None = None,
    gathered: torch.Tensor | None = None,
    post_forward_world: int = 1,
    post_forward_group: str = "",
    piece_group: str = "",
) -> torch.Tensor:
    """The unit's full padded flat parameter: `shard` copied to `compute_device` (CPU offload; None: where it
    is), cast to `dtype`, then all-gathered over `group` (`world` == 1: nothing to gather, NO_SHARD). With a
    `compute_device` the gradient shard is copied back to the shard's device. `reduce_group` (same ranks as
    `group`; "": `group` itself) is where the gradient is reduce-scattered.

    `reduce_dtype` is the dtype its gradient is reduced in (None: the gradient's own dtype);
    `reshard_after_forward` tells the reshard pass whether the backward re-gathers (True) or the forward
    saves the gathered tensor (False); `replicate_group`/`replicate_world` name the group the gradient is
    all-reduced over after the reduce-scatter (HYBRID_SHARD, NO_SHARD; 1: none); `divide_factor` is what the
    reduced gradient is divided by (None: the data-parallel size, a mean; see `gradient_divide_factors`).

    Gradient sync (`no_sync`) only changes the backward, through `sync` and `unsynced`:
    - `sync=False`: `unsynced` is a full-size leaf; the unreduced gradient becomes ITS gradient (autograd
      accumulates it over microbatches) and the shard gets none, so nothing is communicated.
    - `sync=True` with `unsynced` (that leaf, holding an accumulated gradient): the backward takes the gradient
      (`take_accumulated`) and adds it before the one reduction; a later backward finds none left to add.

    Replica all-reduce (`set_requires_all_reduce`, HYBRID) likewise, through `all_reduce` and `partial`:
    - `all_reduce=False`: `partial` is a shard-size leaf on the device gradients are reduced on (`compute_device`
      under CPU offload); the reduce-scattered, not yet all-reduced sum becomes ITS gradient (accumulated by
      autograd, no copy) and the shard gets none.
    - `all_reduce=True` with `partial` (that leaf, holding a partial sum): the backward takes it and adds it before
      the all-reduce.

    `gathered` (`set_reshard_after_backward(False)` in a compiled step): this flat parameter as gathered by an
    earlier step and kept; the forward communicates nothing and returns it (the lowering pass forwards the input
    itself; called eagerly, a copy, since an op's output cannot alias its input). The backward is unchanged.

    `post_forward_world` k > 1 (`reshard_after_forward=k`): the gather runs in two steps over the (world / k, k)
    arrangement of `group`: the 1/k piece over `piece_group` (the world / k ranks at this rank's position in its
    node group of k consecutive ranks), then the pieces over `post_forward_group` (that node group), and
    `rank_order` puts the shards back in rank order. Same result and bytes as one gather; the reshard pass lets the
    forward save only the piece, so the backward gathers within the node group only. The reduction is unchanged.
    """
    if gathered is not None:
        return gathered.clone()
    if post_forward_world > 1:
        pieces = world // post_forward_world
        piece = wait_gather(start_gather(shard, piece_group, pieces, dtype, compute_device), pieces)
        return gather_pieces(piece, post_forward_group, post_forward_world, world)
    return wait_gather(start_gather(shard, group, world, dtype, compute_device), world)


def gather_pieces(piece: torch.Tensor, group: str, k: int, world: int) -> torch.Tensor:
    """The full flat parameter, in rank order, from this rank's 1/k piece (`unshard`'s second step; the eager
    backward's re-gather under `reshard_after_forward=k`)."""
    gathered = issue("all_gather", _c10d.all_gather_into_tensor, piece.contiguous(), k, group)
    return rank_order(wait_gather(gathered, k), k, world)


def rank_order(node_major: torch.Tensor, k: int, world: int) -> torch.Tensor:
    """The node group's gather of pieces, `(k, world / k, shard)` (piece j holds the shards of ranks j, j + k, ...),
    as the rank-order flat `(world / k, k, shard)`: a transpose, the same code on every rank."""
    return node_major.view(k, world // k, -1).transpose(0, 1).reshape(-1)


def piece_of(flat: torch.Tensor, k: int, world: int, shard_rank: int) -> torch.Tensor:
    """Rank `shard_rank`'s 1/k piece of a rank-order flat parameter (what its `piece_group` gather gives it): the
    shards of ranks j, j + k, ... with j = shard_rank % k its position in its node group. A copy (the flat can be
    freed); eager only, since it depends on the rank."""
    return flat.view(world // k, k, -1)[:, shard_rank % k].clone(memory_format=torch.contiguous_format).view(-1)


def start_gather(
    shard: torch.Tensor, group: str, world: int, dtype: torch.dtype | None, compute_device: torch.device | None
) -> torch.Tensor:
    """The first half of `unshard` (also `FSDPModule.unshard(async_op=True)`): the copy, cast and all-gather
    issued; `wait_gather` gives the full flat parameter."""
    moved = shard if compute_device is None else shard.to(compute_device, non_blocking=True)
    cast = _cast(moved, dtype)
    if world == 1:
        return cast.clone() if cast is shard else cast
    return issue("all_gather", _c10d.all_gather_into_tensor, cast.contiguous(), world, group)


def wait_gather(started: torch.Tensor, world: int) -> torch.Tensor:
    return started if world == 1 else _c10d.wait_tensor(started)


UNSHARD_SIGNATURE = OpSignature(torch.ops.fsdp.unshard.default)


@unshard.register_fake
def _unshard_fake(*args, **kwargs):
    a = UNSHARD_SIGNATURE.bind(args, kwargs)
    return a.shard.new_empty(
        a.shard.numel() * a.world, dtype=a.dtype or a.shard.dtype, device=a.compute_device or a.shard.device
    )


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
    out_device: torch.device | None = None,
    divide_factor: float | None = None,
    all_reduce: bool = True,
    partial: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's shard of the gradient averaged over all `world * replicate_world` data-parallel ranks (or
    summed and divided by `divide_factor`):
    cast to `dtype`, divided by `pre`, reduce-scattered (sum) over `group`, all-reduced (sum) over
    `replicate_group`, divided by `post` (`gradient_divide_factors`), returned in `out_dtype` (on `out_device`,
    CPU offload; None: where it was computed). `partial` (a partial sum accumulated without all-reduce) is added
    after the reduce-scatter; `all_reduce=False` stops there and returns the partial sum (neither all-reduced nor
    divided by `post`).

    Sums and divisions: "avg" has no autograd formula and is not supported by every process-group backend.
    A wide-range reduce dtype moves the division by `pre` after the reduction, here and in the lowered graph
    (`reduction_divisors`): the same bits, one pass over the full gradient fewer.
    """
    grad = _cast(full_grad, dtype).contiguous()
    accumulates = partial is not None or not all_reduce
    before, after_scatter, last = reduction_divisors(world * replicate_world, divide_factor, grad.dtype, accumulates)
    if before > 1:
        grad = grad / before
    if world > 1 and is_gloo_group(
        group, grad.device
    ):  # as passes.all_to_all lowers it: gloo has no native reduce-scatter
        chunk = grad.numel() // world
        grad = _c10d.wait_tensor(
            issue("reduce_scatter", _c10d.all_to_all_single, grad, [chunk] * world, [chunk] * world, group)
        )
        grad = grad.view(world, chunk).sum(0)
    elif world > 1:
        grad = _c10d.wait_tensor(issue("reduce_scatter", _c10d.reduce_scatter_tensor, grad, "sum", world, group))
    if after_scatter > 1:
        grad = grad / after_scatter
    if partial is not None:
        grad = grad + partial.to(grad.device, grad.dtype)
    if not all_reduce:
        averaged = _cast(grad, out_dtype)
        return averaged if out_device is None else averaged.to(out_device, non_blocking=True)
    if replicate_world > 1:
        grad = _c10d.wait_tensor(issue("all_reduce", _c10d.all_reduce, grad, "sum", replicate_group))
    averaged = _cast(grad / last, out_dtype)
    return averaged if out_device is None else averaged.to(out_device, non_blocking=True)


def reduction_divisors(
    data_parallel_size: int, divide_factor: float | None, dtype: torch.dtype | None, accumulates: bool
) -> tuple[int, int, int | float]:
    """(before, after_scatter, last): what a gradient reduced in `dtype` is divided by before its reduce-scatter,
    right after it, and after the all-reduce (1: no division); `accumulates`: a partial sum is added after the
    reduce-scatter, or the all-reduce is skipped. The one rule the eager op and `passes.lower` share.

    A reduce dtype with fp32's range (fp32, bf16, fp64) is divided by `pre` after the reduction, together with
    `post`: `pre` is a power of two, so dividing by it commutes with every rounding of the sum (short of under- or
    overflow near 1e-38 / 3e38), the same bits as dividing first, without a pass over the full gradient. Where a
    partial sum is added (it is divided by `pre`) or nothing follows, that division comes right after the
    reduce-scatter. fp16 (max 65504), or an unknown dtype: dividing first is what keeps the sum finite
    (`gradient_divide_factors`), so it stays before the reduction."""
    pre, post = gradient_divide_factors(data_parallel_size, divide_factor)
    if pre == 1 or dtype is None or torch.finfo(dtype).max < 1e38:
        return pre, 1, post
    return (1, pre, post) if accumulates else (1, 1, post * pre)


REDUCE_SIGNATURE = OpSignature(torch.ops.fsdp.reduce_grad.default)


@reduce_grad.register_fake
def _reduce_grad_fake(*args, **kwargs):
    a = REDUCE_SIGNATURE.bind(args, kwargs)
    return a.full_grad.new_empty(
        a.full_grad.numel() // a.world, dtype=a.out_dtype, device=a.out_device or a.full_grad.device
    )


def reduce_args(a: Any) -> dict[str, Any]:
    """The `fsdp.reduce_grad` arguments (all but `full_grad` and `partial`) for the gradient of an `fsdp.unshard`
    call with bound arguments `a`: what its backward reduces with, and what a reduction outside any backward (the
    pipeline stage's, `fsdp_graph.api.sync.reduce_accumulated`) must use to give the same result."""
    return {
        "unit": a.unit,
        "group": a.reduce_group or a.group,
        "world": a.world,
        "dtype": a.reduce_dtype,
        "out_dtype": a.shard.dtype,
        "replicate_group": a.replicate_group,
        "replicate_world": a.replicate_world,
        "out_device": None if a.compute_device is None else a.shard.device,
        "divide_factor": a.divide_factor,
        "all_reduce": a.all_reduce,
    }


# Accumulator leaves by storage address (`register_accumulator`): a compiled backward gets a detached alias of the
# leaf the forward was given, which shares its storage but not its `.grad`.
_ACCUMULATORS: dict[int, weakref.ref] = {}


def register_accumulator(leaf: torch.Tensor) -> None:
    """Make `leaf` (an accumulator leaf of the runtime: no_sync's, set_requires_all_reduce's) findable by
    `take_accumulated` from any tensor sharing its storage."""
    address = leaf.untyped_storage().data_ptr()

    def forget(ref: weakref.ref) -> None:
        if _ACCUMULATORS.get(address) is ref:
            del _ACCUMULATORS[address]

    _ACCUMULATORS[address] = weakref.ref(leaf, forget)


@torch.library.custom_op("fsdp::take_accumulated", mutates_args=())
def take_accumulated(accumulator: torch.Tensor) -> torch.Tensor:
    """The gradient pending in the `.grad` of the accumulator leaf `accumulator` is (or aliases), taken: that `.grad`
    is None afterwards. Called by the op's backward when it reduces (eager, or inside a compiled backward: an op,
    so it runs then), it gives an accumulated gradient to exactly one reduction, as FSDP2's post-backward does,
    whichever backward of the step comes first; the others get zeros."""
    ref = _ACCUMULATORS.get(accumulator.untyped_storage().data_ptr())
    leaf = ref() if ref is not None else None
    if leaf is None:
        raise RuntimeError(
            "fsdp::take_accumulated: the gradient accumulator reached the backward as a copy (a saved-tensor hook "
            "that copies, e.g. save_on_cpu, around a compiled forward?); accumulated gradients cannot be found. "
            "Run that forward without the hook, or eagerly."
        )
    pending = leaf.grad
    if pending is None:
        return torch.zeros(leaf.shape, dtype=leaf.dtype, device=leaf.device)
    leaf.grad = None
    return pending


@take_accumulated.register_fake
def _take_accumulated_fake(accumulator: torch.Tensor) -> torch.Tensor:
    return torch.empty(accumulator.shape, dtype=accumulator.dtype, device=accumulator.device)


def _unshard_setup_context(ctx, inputs, output) -> None:
    a = UNSHARD_SIGNATURE.bind(inputs, {})
    ctx.reduce_args = reduce_args(a)
    ctx.sync = a.sync
    # The accumulator leaves themselves, not saved tensors: a saved tensor comes back as another tensor object
    # whenever saved-tensor hooks run (every eager forward has ours), without the `.grad` the backward takes.
    ctx.unsynced, ctx.partial = a.unsynced, a.partial


def _unshard_backward(ctx, grad: torch.Tensor):
    unsynced, partial = ctx.unsynced, ctx.partial
    if not ctx.sync:  # no_sync: the unreduced gradient goes to the accumulator leaf, nothing to the shard
        return UNSHARD_SIGNATURE.gradients(unsynced=grad.to(unsynced.dtype))
    if unsynced is not None:  # the last microbatch after no_sync: one reduction of everything accumulated
        grad = grad.to(unsynced.dtype) + take_accumulated(unsynced)
    if not ctx.reduce_args["all_reduce"]:  # the partial sum goes to the partial leaf, nothing to the shard
        # The leaf lives where gradients are reduced (CPU offload included): no copy to the shard's device.
        args = {"full_grad": grad, **ctx.reduce_args, "out_device": None}
        reduced = reduce_grad(*REDUCE_SIGNATURE.call_args(args))
        return UNSHARD_SIGNATURE.gradients(partial=reduced.to(partial.dtype))
    if partial is not None:
        partial = take_accumulated(partial)
    reduced = reduce_grad(*REDUCE_SIGNATURE.call_args({"full_grad": grad, **ctx.reduce_args, "partial": partial}))
    return UNSHARD_SIGNATURE.gradients(shard=reduced)


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup_context)
count_inside(unshard)
count_inside(reduce_grad)


class _ReuseGathered(torch.autograd.Function):
    """`fsdp::unshard` of a flat parameter gathered earlier and kept (`set_reshard_after_backward(False)`): the
    forward communicates nothing and returns the kept tensor (as a view); the backward is the op's own formula, so
    the gradient reaches the shard exactly as after a gather. Eager only: compiled graphs always gather."""

    @staticmethod
    def forward(gathered: torch.Tensor, *unshard_args: Any) -> torch.Tensor:
        return gathered

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _unshard_setup_context(ctx, inputs[1:], output)
        ctx.arg_count = len(inputs) - 1

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (None, *_unshard_backward(ctx, grad)[: ctx.arg_count])


def reuse_gathered(gathered: torch.Tensor, *unshard_args: Any) -> torch.Tensor:
    """What `torch.ops.fsdp.unshard(*unshard_args)` returns, taken from `gathered` (the same flat parameter gathered
    earlier, not requiring grad) instead of a new gather; differentiable to `shard` like the op."""
    return _ReuseGathered.apply(gathered, *unshard_args)


@torch.library.custom_op("fsdp::rows_copy_out", mutates_args=())
def rows_copy_out(gathered: torch.Tensor, world: int, shard: int, start: int, width: int) -> torch.Tensor:
    """Columns `[start, start + width)` of the gathered flat parameter viewed as `(world, shard)`, copied into a new
    contiguous `(world, width)` tensor: the rows layout's copy-out of one parameter (`RowShardLayout.param_of`),
    every rank's block of it. One opaque op rather than view, slice and clone, so that Inductor runs it as one copy
    and its consumers read a plain buffer instead of each carrying the strided read (docs/design-notes.md, "The
    rows layout's copy-out is one op"). Its gradient is the copy-in: the columns placed into zeros."""
    return gathered.view(world, shard)[:, start : start + width].clone(memory_format=torch.contiguous_format)


@rows_copy_out.register_fake
def _rows_copy_out_fake(gathered: torch.Tensor, world: int, shard: int, start: int, width: int) -> torch.Tensor:
    return gathered.new_empty((world, width))


def _rows_copy_out_setup_context(ctx, inputs, output) -> None:
    gathered, ctx.world, ctx.shard, ctx.start, ctx.width = inputs
    ctx.gathered_shape = gathered.shape


def _rows_copy_out_backward(ctx, grad: torch.Tensor):
    # slice_backward: what autograd made of the view-slice-clone this op replaces, so the backward graph (and
    # passes.flat_grad's match of it) is the same as before
    end = ctx.start + ctx.width
    placed = torch.ops.aten.slice_backward(grad, [ctx.world, ctx.shard], 1, ctx.start, end, 1)
    return placed.view(ctx.gathered_shape), None, None, None, None


rows_copy_out.register_autograd(_rows_copy_out_backward, setup_context=_rows_copy_out_setup_context)
