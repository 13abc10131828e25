"""Rank-side worker for parity under injected delays (FSDP2's own test technique): one rank at a time sleeps at one
point of a training step, so the ranks reach their collectives out of step, and the result must not change.

The delays go in through the `_c10d_functional` ops the lowered graph calls: both the eager-kernel graph (an FX
GraphModule's code) and Inductor's output code look them up as `torch.ops._c10d_functional.<op>.default` at each
call, so patching that attribute on the op's packet wraps every call the compiled step makes, and nothing else."""

from __future__ import annotations

import contextlib
import copy
import time
from collections import Counter
from collections.abc import Callable, Iterator
from unittest import mock

import torch
import torch.distributed as dist

import fsdp_graph
from tests.workers.training import Case, build, shard_and_compile

DELAY_S = 0.06
POINTS = ("gather_wait", "reduce_issue", "compute_before_prefetched_gather", "optimizer_step")
_C10D = torch.ops._c10d_functional
_GATHERS = ("all_gather_into_tensor", "all_gather_into_tensor_out")
_REDUCES = ("reduce_scatter_tensor", "all_to_all_single")  # gloo groups reduce gradients with an all-to-all


def _wrapped(op_name: str, wrapper: Callable[[Callable], Callable]) -> contextlib.AbstractContextManager:
    packet = getattr(_C10D, op_name)
    return mock.patch.object(packet, "default", wrapper(packet.default))


@contextlib.contextmanager
def delayed(point: str, fired: Counter) -> Iterator[None]:
    """Sleep DELAY_S at `point` of the collectives run inside the block (on the calling rank), counting each sleep
    in `fired[point]`: before each all-gather's wait, before each gradient reduction is issued, or before each
    all-gather after the step's first is issued (the prefetched ones: the compute before them runs late)."""
    gathered: set[int] = set()  # ids of all-gather results not yet waited on
    gathers_issued = [0]

    def sleep() -> None:
        time.sleep(DELAY_S)
        fired[point] += 1

    def gather(original: Callable) -> Callable:
        def issue(*args, **kwargs):
            gathers_issued[0] += 1
            if point == "compute_before_prefetched_gather" and gathers_issued[0] > 1:
                sleep()
            out = original(*args, **kwargs)
            gathered.add(id(out))
            return out

        return issue

    def wait(original: Callable) -> Callable:
        def wait_tensor(t, *args, **kwargs):
            if id(t) in gathered:
                gathered.discard(id(t))
                if point == "gather_wait":
                    sleep()
            return original(t, *args, **kwargs)

        return wait_tensor

    def reduce(original: Callable) -> Callable:
        def issue(*args, **kwargs):
            if point == "reduce_issue":
                sleep()
            return original(*args, **kwargs)

        return issue

    with contextlib.ExitStack() as stack:
        for name in _GATHERS:
            stack.enter_context(_wrapped(name, gather))
        for name in _REDUCES:
            stack.enter_context(_wrapped(name, reduce))
        stack.enter_context(_wrapped("wait_tensor", wait))
        yield


def delayed_parity(rank: int, world: int, mode: str, bucket_bytes: int) -> dict:
    """GPT with prefetch (make_backend's default), bucketing and CPU offload, SGD with momentum, against the same
    model in one process on the full batch. Step 0 compiles without delays; then each (point, rank) pair gets one
    step in which that rank sleeps at that point. Returns the largest differences and how often each delay fired."""
    torch.manual_seed(0)
    model, loss_fn, make_batch = build("gpt")
    ref = copy.deepcopy(model)
    compiled, backend = shard_and_compile(model, Case("gpt", mode=mode, offload=True, bucket_bytes=bucket_bytes))
    opt = torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=5e-2, momentum=0.9)
    schedule = [None] + [(point, r) for point in POINTS for r in range(world)]
    gen = torch.Generator().manual_seed(1234)
    fired: Counter = Counter()
    loss_diffs = []
    for delay in schedule:
        full = make_batch(gen, 4 * world)
        local = tuple(t.chunk(world)[rank] for t in full)
        mine = delay is not None and delay[1] == rank
        collectives = delayed(delay[0], fired) if mine and delay[0] != "optimizer_step" else contextlib.nullcontext()
        with collectives:
            loss = loss_fn(compiled, local)
            loss.backward()
        if mine and delay[0] == "optimizer_step":
            time.sleep(DELAY_S)
            fired["optimizer_step"] += 1
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)
        ref_loss = loss_fn(ref, full)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_diffs.append(abs(value.item() / world - ref_loss.item()))
    full_params, ref_params = fsdp_graph.full_state_dict(model), ref.state_dict()
    param_diffs = [(full_params[k] - v).abs().max() for k, v in ref_params.items()]
    return {  # torch's max, not Python's: a NaN must not hide behind a comparison
        "loss_diff": torch.tensor(loss_diffs).max().item(),
        "param_diff": torch.stack(param_diffs).max().item(),
        "fired": dict(fired),
        # The outer forward's: with the block-reuse default, Inductor also reports each shared body (no collectives).
        "forward_collectives": next(
            (dict(r.collectives.counts) for r in backend.reports if r.stage == "fw" and r.collectives.counts), {}
        ),
        "dynamo_graphs": backend.dynamo_graphs,
    }


def delayed_parity_cases(rank: int, world: int, cases: list[tuple[str, int]]) -> list[dict]:
    """`delayed_parity` for each (mode, bucket_bytes), in one launch."""
    return [delayed_parity(rank, world, mode, bucket_bytes) for mode, bucket_bytes in cases]
