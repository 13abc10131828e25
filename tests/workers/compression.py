"""Compressed collectives against a single-process reference that quantizes the same way (run inside each rank).

The reference, for every rank r of the world (all in this process): each unit's full flat parameter, cut into the
ranks' shards, goes through `passes.quantize` per shard (what the compressed gather delivers, also with
`reshard_after_forward=k`, whose node gather re-packs each shard's blocks as they came; fp8 in the rows layout: one
scale per row of each parameter); rank r's batch is run through the model with those parameters; the flat gradient
is divided by the reduction's `pre`, cut into one row per receiving rank of its shard group and quantized per row
(what the compressed all-to-all delivers); the rows are summed in float32. Over replicas (HYBRID_SHARD, NO_SHARD)
each summed shard is cut into one row per replica, quantized, summed per row, each sum quantized again (the
all-gather's), and divided by `post`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import fsdp_graph
from fsdp_graph.ir import gradient_divide_factors
from fsdp_graph.runtime.unit import flat_params
from passes.quantize import Segments, pack_rows, round_trip, unpack_rows
from tests.workers.training import build, full_grads


@dataclass(frozen=True)
class CompressCase:
    strategy: str = "FULL_SHARD"
    weights: str | None = "int8"
    grads: str | None = "int8"
    block_size: int = 64
    mode: str = "aot"  # "aot": eager kernels; "inductor"
    steps: int = 3  # SGD with momentum; gradients compared at every step
    reshard_after_forward: bool | int | None = None  # None: the strategy's default
    model: str = "gpt"  # a `tests.workers.training.build` name


@dataclass
class CompressResult:
    case: CompressCase
    max_grad_diff: float  # compiled vs the quantizing reference, over every step
    max_uncompressed_gap: float  # the reference's gradients vs the same step without quantization: not vacuous
    max_loss_diff: float
    max_param_diff: float  # after the last step
    gathered_dtypes: tuple[str, ...]  # of every all-gather / all-to-all input in the lowered graphs
    collective_bytes: int  # the lowered graphs' collective payloads


def _fp8_rows(layout) -> Segments | None:
    """fp8 weights in the rows layout: one scale per row of each parameter's block (a 1-D parameter: the block)."""
    if layout.kind != "rows":
        return None
    blocks = [(layout.block_numel(s), s.shape[1:].numel() if len(s.shape) > 1 else 0) for s in layout.slots]
    return tuple((n, row or n) for n, row in blocks if n)


def _quantized_flats(ref: nn.Module, case: CompressCase, states) -> list[torch.Tensor]:
    params = dict(ref.named_parameters())
    flats = []
    for state in states:
        layout = state.layout
        flat = layout.flatten([params[slot.fqns[0]] for slot in layout.slots]).detach()
        if case.weights is not None and state.world > 1:
            shards = flat.view(state.world, -1)
            segments = _fp8_rows(layout) if case.weights == "fp8" else None
            flat = torch.cat([round_trip(shard, case.weights, case.block_size, segments) for shard in shards])
        flats.append(flat.requires_grad_())
    return flats


def _quantized_rows(rows: torch.Tensor, case: CompressCase) -> torch.Tensor:
    if case.grads is None:
        return rows
    n, chunk = rows.shape
    packed = pack_rows(rows.contiguous(), n, chunk, case.grads, case.block_size)
    return unpack_rows(packed, n, chunk, rows.dtype, case.grads, case.block_size)


def _summed(rows: list[torch.Tensor]) -> torch.Tensor:
    """Row j of every rank summed, in rank order: the same reduction as the graph's sum over dim 0."""
    return torch.stack([torch.stack([r[j] for r in rows]).sum(0) for j in range(len(rows[0]))])


def _replica_all_reduce(shards: list[torch.Tensor], case: CompressCase) -> torch.Tensor:
    """The compressed all-reduce of one shard over its R replicas (`shards`, in replica order): R row pieces."""
    replicas, n = len(shards), shards[0].numel()
    if case.grads is None:
        return torch.stack(shards).sum(0)
    chunk = -(-n // replicas)
    rows = [_quantized_rows(F.pad(s, (0, chunk * replicas - n)).view(replicas, chunk), case) for s in shards]
    return _quantized_rows(_summed(rows), case).view(-1)[:n]


def _reduced(grads: list[torch.Tensor], state, case: CompressCase) -> torch.Tensor:
    """The ranks' flat gradients (global rank order; rank = replica * world + shard rank) reduced as the compressed
    graph does (or exactly, without `grads`): over each shard group, then over the replicas."""
    world, replicas = state.world, state.replicate_world
    pre, post = gradient_divide_factors(world * replicas)
    rows = [_quantized_rows((g / pre).view(world, -1), case) if world > 1 else (g / pre).view(1, -1) for g in grads]
    per_replica = [_summed(rows[i * world : (i + 1) * world]) for i in range(replicas)]
    if replicas > 1:
        shards = [_replica_all_reduce([p[j] for p in per_replica], case) for j in range(world)]
        return torch.cat(shards) / post
    return per_replica[0].view(-1) / post


def reference_grads(ref: nn.Module, loss_fn, states, batches: list, case: CompressCase, quantize: bool = True):
    """{fqn: gradient} and the mean loss for one step over every rank's batch (see the module docstring)."""
    used = case if quantize else CompressCase(case.strategy, None, None, case.block_size)
    flats = _quantized_flats(ref, used, states)
    per_rank, losses = [[] for _ in states], []
    for batch in batches:
        values = {}
        for state, flat in zip(states, flats):
            for slot, value in zip(state.layout.slots, state.layout.unflatten(flat)):
                for fqn in slot.fqns:
                    values[fqn] = value
        loss = loss_fn(lambda *a, values=values: torch.func.functional_call(ref, values, a), batch)
        for grads, g in zip(per_rank, torch.autograd.grad(loss, flats)):
            grads.append(g)
        losses.append(loss.item())
    out = {}
    for state, grads in zip(states, per_rank):
        reduced = _reduced(grads, state, used)
        for slot, grad in zip(state.layout.slots, state.layout.unflatten(reduced)):
            for fqn in slot.fqns:
                out[fqn] = grad
    return out, sum(losses) / len(losses)


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def run_case(case: CompressCase, rank: int, world: int, per_rank_batch: int = 2) -> CompressResult:
    torch.manual_seed(0)
    model, loss_fn, make_batch = build(case.model)
    ref = copy.deepcopy(model)
    strategy = fsdp_graph.ShardingStrategy[case.strategy]
    mesh = init_device_mesh("cpu", (2, world // 2)) if strategy.is_hybrid else None
    fsdp_graph.fully_shard(model, mesh, strategy=strategy, reshard_after_forward=case.reshard_after_forward)
    compression = fsdp_graph.Compression(case.weights, case.grads, case.block_size)
    backend = fsdp_graph.make_backend(inductor=case.mode == "inductor", compress=compression)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=5e-2, momentum=0.9)
    states = flat_params(model)
    gen = torch.Generator().manual_seed(1234)
    grad_diff = gap = loss_diff = 0.0
    for _ in range(case.steps):
        full = make_batch(gen, per_rank_batch * world)
        batches = [tuple(t.chunk(world)[r] for t in full) for r in range(world)]
        loss = loss_fn(compiled, batches[rank])
        loss.backward()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        grads = full_grads(model)
        ref_grads, ref_loss = reference_grads(ref, loss_fn, states, batches, case)
        exact, _ = reference_grads(ref, loss_fn, states, batches, case, quantize=False)
        grad_diff = max(grad_diff, _max_diff(ref_grads, grads))
        gap = max(gap, _max_diff(ref_grads, exact))
        loss_diff = max(loss_diff, abs(global_loss.item() / world - ref_loss))
        for name, p in ref.named_parameters():
            p.grad = ref_grads[name].clone()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    full_params = fsdp_graph.full_state_dict(model)
    param_diff = max((full_params[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    dtypes, total = [], 0
    for report in backend.reports:
        dtypes += [line for line in report.fingerprint]
        total += sum(report.collectives.bytes.values())
    return CompressResult(case, grad_diff, gap, loss_diff, param_diff, tuple(dtypes), total)


def run_cases(rank: int, world: int, cases: list[CompressCase]) -> list[CompressResult]:
    return [run_case(c, rank, world) for c in cases]
