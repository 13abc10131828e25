"""Rank-side workers for the scheduling passes (issue 4): what actually executes, read from the profiler."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

import fsdp_graph
from fsdp_graph.planning.measure import executed_collectives
from tests.workers.training import build

_MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::_scaled_dot_product")


def _op_stream(fn) -> list[str]:
    """Run `fn` under the profiler: "gather", "wait" and "matmul" in execution order."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    kinds = []
    for _, name in sorted((e.start_ns(), e.name()) for e in prof.profiler.kineto_results.events()):
        if name.startswith("_c10d_functional::all_gather_into_tensor"):
            kinds.append("gather")
        elif name.startswith("_c10d_functional::wait_tensor"):
            kinds.append("wait")
        elif name.startswith(_MATMULS):
            kinds.append("matmul")
    return kinds


def forward_op_stream(rank: int, world: int, prefetch: bool) -> list[str]:
    """The gathers, waits and matmuls of the second compiled forward (eager kernels) of the test GPT (the first
    compiles)."""
    torch.manual_seed(0)
    model, _, make_batch = build("gpt")
    fsdp_graph.fully_shard(model)
    backend = fsdp_graph.make_backend(inductor=False, prefetch=prefetch)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    idx, _ = make_batch(torch.Generator().manual_seed(rank), 2)
    compiled(idx).sum().backward()
    return _op_stream(lambda: compiled(idx))


def reduce_scatter_bytes(rank: int, world: int, reduce_scatter: str) -> dict:
    """What gloo puts on the wire per step for the gradients, with reduce-scatter as gloo runs it (an all-reduce)
    or as an all-to-all, and the resulting gradients (they must agree)."""
    torch.manual_seed(0)
    model, loss_fn, make_batch = build("gpt")
    fsdp_graph.fully_shard(model)
    compiled = torch.compile(model, backend=fsdp_graph.make_backend(inductor=False, reduce_scatter=reduce_scatter))
    batch = make_batch(torch.Generator().manual_seed(rank), 2)
    loss_fn(compiled, batch).backward()
    model.zero_grad()
    seen = executed_collectives(lambda: loss_fn(compiled, batch).backward())
    return {
        "backend_counts": dict(seen.backend_counts),
        "backend_wire_bytes": dict(seen.backend_wire_bytes),
        "grads": [p.grad.clone() for p in model.parameters()],
    }


def separate_reduce_group_parity(rank: int, world: int, strategy: str) -> dict:
    """Gradients reduced over a second process group (what NCCL needs to overlap a reduce-scatter with a gather):
    the numerics are unchanged and the backward's reductions name a group other than the gathers'."""
    import re

    from tests.workers.training import Case, run_case

    result = run_case(Case("gpt", "adamw", strategy=strategy, separate_reduce_group=True), rank, world)
    bw = next(r for r in result.reports if r.stage == "bw")
    groups = {
        kind: set(re.findall(rf"{kind}\.default\(.*'([^']+)'\)", bw.code))
        for kind in ("all_gather_into_tensor", "all_to_all_single")
    }
    return {
        "diff": result.max_param_diff,
        "gather_groups": sorted(groups["all_gather_into_tensor"]),
        "reduce_groups": sorted(groups["all_to_all_single"]),
    }


def activation_budget(rank: int, world: int) -> dict:
    """make_backend(activation_memory_budget=0.3): the forward hands the backward fewer saved bytes than with the
    default budget, and the same compiled model trains like one process (SGD with momentum, 3 steps)."""
    import copy

    from passes.fx_nodes import node_bytes
    from tests.workers.training import max_param_diff

    saved, diff = {}, None
    for budget in (None, 0.3):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model, loss_fn, make_batch = build("gpt")
        ref = copy.deepcopy(model)
        fsdp_graph.fully_shard(model)
        backend = fsdp_graph.make_backend(inductor=False, keep_graphs=True, activation_memory_budget=budget)
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        opt = torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=5e-2, momentum=0.9)
        gen = torch.Generator().manual_seed(0)
        for _ in range(1 if budget is None else 3):
            full = make_batch(gen, 4 * world)
            loss_fn(compiled, tuple(t.chunk(world)[rank] for t in full)).backward()
            loss_fn(ref, full).backward()
            for optimizer in (opt, ref_opt):
                optimizer.step()
                optimizer.zero_grad()
        fw = next(r.graph for r in backend.reports if r.stage == "fw")
        outputs = next(n for n in fw.graph.nodes if n.op == "output").args[0]
        saved[budget] = sum(node_bytes(n) for n in outputs[1:] if isinstance(n, torch.fx.Node))  # [0]: the logits
        diff = max_param_diff(model, ref)
    return {"diff": diff, "saved_default": saved[None], "saved_budget": saved[0.3]}
