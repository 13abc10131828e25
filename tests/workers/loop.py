"""Rank-side workers for the training-loop features (issue 5)."""

from __future__ import annotations

import copy

import torch

import fsdp_graph
from tests.workers.training import Case, build, full_grads, is_shard_view, max_param_diff, run_case, shard_and_compile


def clip_matches_pytorch(rank: int, world: int, strategy: str, mode: str) -> dict[str, float]:
    """Our clip_grad_norm_ vs torch.nn.utils.clip_grad_norm_ on the full-batch reference, for several norms (one
    model compiled once: each norm recomputes the gradients from zero, so the earlier clips leave no trace)."""
    out = {}
    torch.manual_seed(0)
    model, loss_fn, make_batch = build("gpt")
    ref = copy.deepcopy(model)
    compiled, _ = shard_and_compile(model, Case("gpt", strategy=strategy, mode=mode))
    full = make_batch(torch.Generator().manual_seed(9), 4 * world)
    for norm_type, max_norm in ((2.0, 0.05), (float("inf"), 0.01), (1.0, 1e6)):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        loss_fn(compiled, tuple(t.chunk(world)[rank] for t in full)).backward()
        loss_fn(ref, full).backward()
        ours = fsdp_graph.clip_grad_norm_(model, max_norm, norm_type)
        theirs = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
        grads = full_grads(model)
        out[f"norm_{norm_type}"] = abs(ours.item() - theirs.item()) / theirs.item()
        out[f"grads_{norm_type}"] = max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())
        out[f"clipped_{norm_type}"] = float(theirs.item() > max_norm)
    return out


def summon_checks(rank: int, world: int) -> dict[str, float]:
    torch.manual_seed(0)
    model, loss_fn, make_batch = build("gpt")
    ref = copy.deepcopy(model)
    fsdp_graph.fully_shard(model)
    full = make_batch(torch.Generator().manual_seed(3), 4 * world)
    loss_fn(model, tuple(t.chunk(world)[rank] for t in full)).backward()
    loss_fn(ref, full).backward()
    out = {}
    with fsdp_graph.summon_full_params(model, with_grads=True):
        out["shapes"] = float(all(p.shape == q.shape for p, q in zip(model.parameters(), ref.parameters())))
        out["values"] = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
        out["grads"] = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
        out["tied"] = float(model.tok.weight is model.head.weight)
        with torch.no_grad():
            model.blocks[0].fc.weight.mul_(2.0)  # writeback=True: lands in the shards
    with fsdp_graph.summon_full_params(model, writeback=False), torch.no_grad():
        model.blocks[1].fc.weight.zero_()  # writeback=False: discarded
    with torch.no_grad():
        ref.blocks[0].fc.weight.mul_(2.0)
    out["after_writeback"] = max_param_diff(model, ref)
    out["sharded_again"] = float(is_shard_view(model, model.blocks[0].fc.weight))
    with fsdp_graph.summon_full_params(model, rank0_only=True, writeback=False, offload_to_cpu=True):
        out["rank0_only_full"] = float(model.blocks[0].fc.weight.shape == ref.blocks[0].fc.weight.shape)
    return out


def optimizer_in_backward_parity(rank: int, world: int, mode: str) -> dict[str, float]:
    """Stepping inside backward gives exactly the parameters of stepping after it (same sharded model, same
    data), and both track single-process AdamW; every gradient is freed right after its unit's step."""

    def train(in_backward: bool):
        torch.manual_seed(0)
        model, loss_fn, make_batch = build("gpt")
        ref = copy.deepcopy(model)
        compiled, _ = shard_and_compile(model, Case("gpt", mode=mode))
        if in_backward:
            optimizers = fsdp_graph.optimizer_in_backward(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
        else:
            optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)]
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        gen = torch.Generator().manual_seed(8)
        for _ in range(4):
            full = make_batch(gen, 4 * world)
            loss_fn(compiled, tuple(t.chunk(world)[rank] for t in full)).backward()
            if not in_backward:
                optimizers[0].step()
                optimizers[0].zero_grad()
            loss_fn(ref, full).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        leftover = sum(p.grad is not None for p in model.parameters())
        return fsdp_graph.full_state_dict(model), max_param_diff(model, ref), len(optimizers), leftover

    in_bw, in_bw_vs_ref, n_optimizers, leftover = train(True)
    after, after_vs_ref, _, _ = train(False)
    return {
        "vs_step_after_backward": max((in_bw[k] - after[k]).abs().max().item() for k in after),
        "vs_single_process": in_bw_vs_ref,
        "step_after_backward_vs_single_process": after_vs_ref,
        "optimizers": float(n_optimizers),
        "grads_left": float(leftover),
    }


def checkpointing_parity(rank: int, world: int, model_name: str, mode: str) -> dict:
    result = run_case(Case(model_name, "adamw", mode=mode), rank, world)
    return {"diff": result.max_param_diff, "reports": [(r.stage, dict(r.collectives.counts)) for r in result.reports]}


MICROBATCHES = 3


def no_sync_parity(rank: int, world: int, mode: str, how: str) -> dict:
    """Accumulate 3 microbatches with gradient sync off for the first 2, step, repeat: gradients and parameters
    equal single-process training on the concatenated batch; the no_sync backwards communicate nothing and the
    loop settles on a fixed set of graphs."""
    from fsdp_graph.planning.measure import executed_collectives

    torch.manual_seed(0)
    model, loss_fn, make_batch = build("gpt")
    ref = copy.deepcopy(model)
    compiled, backend = shard_and_compile(model, Case("gpt", mode=mode))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(11)
    out = {"grad_diff": 0.0, "no_sync_reduce_scatters": 0.0}
    graphs_after_first_step = 0
    for step in range(3):
        micro = [make_batch(gen, 2 * world) for _ in range(MICROBATCHES)]
        for i, full in enumerate(micro):
            local = tuple(t.chunk(world)[rank] for t in full)
            last = i == MICROBATCHES - 1

            def backward(local=local):
                (loss_fn(compiled, local) / MICROBATCHES).backward()

            if how == "context" and not last:
                with fsdp_graph.no_sync(model):
                    seen = executed_collectives(backward)
            else:
                fsdp_graph.set_requires_gradient_sync(model, last)
                seen = executed_collectives(backward)
            if not last:
                out["no_sync_reduce_scatters"] += seen.counts["all_to_all"] + seen.counts["all_reduce"]
                out["grads_before_sync"] = float(sum(p.grad is not None for p in model.parameters()))
            else:
                out["sync_reduce_scatters"] = float(seen.counts["all_to_all"])
            (loss_fn(ref, full) / MICROBATCHES).backward()
        grads = full_grads(model)
        out["grad_diff"] = max(
            out["grad_diff"], max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())
        )
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        if step == 0 and backend is not None:
            graphs_after_first_step = backend.dynamo_graphs
    out["param_diff"] = max_param_diff(model, ref)
    out["pending_left"] = float(
        any(s.unsynced is not None and s.unsynced.grad is not None for s in fsdp_graph.runtime.unit.flat_params(model))
    )
    if backend is not None:
        out["graphs"] = float(backend.dynamo_graphs)
        out["graphs_after_first_step"] = float(graphs_after_first_step)
    return out


def offload_parity(rank: int, world: int, mode: str, mp: bool) -> dict:
    """CPUOffload(offload_params=True) against single-process training; on a CPU-only machine the compute device
    is the CPU too, but every copy to it and back is in the graph (and runs)."""
    result = run_case(Case("gpt", "sgd" if mp else "adamw", mode=mode, mp=mp, offload=True), rank, world)
    out = {"diff": result.max_param_diff, "loss_gap": max(abs(a - b) for a, b in zip(result.losses, result.ref_losses))}
    if result.reports:
        code = {r.stage: r.code for r in result.reports}
        out["fw_device_puts"] = float(code["fw"].count("prims.device_put"))
        out["bw_device_puts"] = float(code["bw"].count("prims.device_put"))
    return out
