"""A compiled graph's outputs record, when their gradient arrives, which parameter reads it reaches
(`runtime.grad_presence`; the reads per output come from `passes.grad_reads`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from fsdp_graph.runtime.grad_presence import arm, on_gradient
from passes.grad_reads import GatheredRead


def watch_gradients(compiled: Callable, reads: list[GatheredRead]) -> Callable:
    """`compiled`, arming each flat shard it reads and hooking each output that requires grad (Dynamo's boxed
    calling convention kept). Unchanged when the graph reads no gathered parameter with a gradient, or when the
    compiler gave no callable (Dynamo then reports the failed compile itself)."""
    if not reads or not callable(compiled):
        return compiled
    inputs = sorted({read.shard_input for read in reads})
    always: dict[int, set] = defaultdict(set)
    per_output: dict[int, dict[int, set]] = defaultdict(lambda: defaultdict(set))
    for read in reads:
        if read.always:
            always[read.shard_input].add(read.position)
        bits, index = read.outputs, 0
        while bits:
            if bits & 1:
                per_output[index][read.shard_input].add(read.position)
            bits, index = bits >> 1, index + 1
    outputs = [(index, [(i, tuple(p)) for i, p in targets.items()]) for index, targets in per_output.items()]

    def run(*args):
        # Graph inputs are tensors and numbers: a single list is the boxed convention (which callers use is not
        # what `_boxed_call` says: aot_module_simplified's unboxed wrapper copies the attribute).
        given = args[0] if len(args) == 1 and isinstance(args[0], list) else args
        shards = {i: given[i] for i in inputs}  # taken first: a boxed call empties its argument list
        result = compiled(*args)
        for i, shard in shards.items():
            if shard.requires_grad:
                arm(shard).update(always.get(i, ()))
        for index, targets in outputs:
            out = result[index]
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(
                    on_gradient((shards[i], positions) for i, positions in targets if shards[i].requires_grad)
                )
        return result

    if getattr(compiled, "_boxed_call", False):
        run._boxed_call = True  # type: ignore[attr-defined]
    return run
