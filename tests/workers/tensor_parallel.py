"""Rank-side workers for tensor parallel x FSDP (issue 14): `parallelize_module(model, world_mesh["tp"], plan)`, then
`fully_shard(model, world_mesh["dp"])`, compiled into one graph."""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint

import fsdp_graph
from fsdp_graph.planning.measure import executed_collectives
from tests.workers.tp_checks import (
    _grad_checks,
    _local,
    _max_abs,
    _optim_state_dict_checks,
    _state_dict_checks,
    _view_checks,
    expected_local,
)
from tests.workers.training import BF16, _bf16_reference_loss, torch_picks_foreach

DIM, HEADS, FFN, BLOCKS = 16, 4, 32, 2
CLIP = 0.05  # below every step's gradient norm: clipping scales every step


class Block(nn.Module):
    """Pre-norm attention and MLP. Head counts come from the projections' local widths (`view(..., -1, hd)`), so
    the same code runs unsharded and with q/k/v split over tensor-parallel ranks (torchtitan divides n_heads)."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))
        self.up, self.down = nn.Linear(DIM, FFN), nn.Linear(FFN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Shapes from the projections' outputs, not from x: under sequence parallelism x holds this rank's part of
        # the sequence, the projections' outputs all of it.
        h = self.norm1(x)
        q, k, v = (proj(h).unflatten(-1, (-1, DIM // HEADS)).transpose(1, 2) for proj in (self.q, self.k, self.v))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(att.transpose(1, 2).flatten(2))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class TinyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, 1)
        self.checkpointed = False  # run each block under torch.utils.checkpoint (non-reentrant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(x)


def tp_plan(sequence_parallel: bool = False) -> dict:
    """q/k/v/up Colwise, o/down Rowwise. `sequence_parallel` (torchtitan's): between the blocks' projections the
    activations are split over tp on the sequence (Shard(1)): `inp` (as torchtitan's embedding) reduce-scatters
    its output onto the sequence, the norms run on their part of it (`SequenceParallel`: Replicate weights, Partial
    gradients), the Colwise layers all-gather it (input layouts Shard(1)), the Rowwise layers reduce-scatter back
    onto it (output layouts Shard(1)), and `PrepareModuleInput` gathers the whole sequence for the head (plain,
    replicated) so the loss sees the whole output."""
    plan: dict = {}
    colwise = {"input_layouts": Shard(1)} if sequence_parallel else {}
    rowwise = {"output_layouts": Shard(1)} if sequence_parallel else {}
    for i in range(BLOCKS):
        plan.update({f"blocks.{i}.{n}": ColwiseParallel(**colwise) for n in ("q", "k", "v", "up")})
        plan.update({f"blocks.{i}.{n}": RowwiseParallel(**rowwise) for n in ("o", "down")})
        if sequence_parallel:
            plan.update({f"blocks.{i}.{n}": SequenceParallel() for n in ("norm1", "norm2")})
    if sequence_parallel:
        plan["inp"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        plan["head"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    return plan


def _optimizers(model: nn.Module, ref: nn.Module, optim: str) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """`optim`: "sgd" (momentum, torch's default implementation: one tensor at a time on CPU), "sgd_foreach", "adamw" or "adamw_foreach" (weight decay on); the reference gets the same. AdamW's
    eps is 1e-3: k's bias has a zero gradient in exact arithmetic (softmax ignores a shift shared by all keys), and
    with the default 1e-8 AdamW scales its rounding noise, which differs between summation orders, to lr-sized
    updates (measured 4e-3 apart; 6e-8 with eps 1e-3, with moments equal to 3e-8 either way)."""
    kind, _, foreach = optim.partition("_")
    kwargs = {"foreach": True} if foreach else {}
    if kind == "sgd":
        return tuple(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, **kwargs) for m in (model, ref))
    return tuple(torch.optim.AdamW(m.parameters(), lr=0.01, eps=1e-3, weight_decay=0.1, **kwargs) for m in (model, ref))


def tp_fsdp_parity(
    rank: int,
    world: int,
    mode: str,
    break_reduce: bool = False,
    clip_norm_type: float | None = None,
    layout: str = "rows",
    mp: bool = False,
    hybrid: bool = False,
    composed: bool = False,
    optim: str = "sgd",
    sequence_parallel: bool = False,
) -> dict[str, float]:
    """(dp=2, tp=2): TP inside each dp group, FSDP across the dp groups. Each dp rank trains on its half of the global
    batch (tp ranks of one dp group share it); 3 steps of SGD with momentum must equal single-process training on
    the global batch. `break_reduce`: sum the dp gradients instead of averaging them (the test must then fail).
    `mp`: MixedPrecision(param_dtype=bf16, reduce_dtype=fp32); the reference computes with bf16 copies.
    `layout`: fully_shard's ("flat": the optimizer's views are 1-D slices, compared as such).
    `clip_norm_type`: clip every step with `fsdp_graph.clip_grad_norm_` against torch's clip on the reference.
    `hybrid`: HSDP x TP on 8 ranks, (replicate=2, shard=2, tp=2), HYBRID_SHARD over ("replicate", "shard"); the
    batch is split over the 4 data-parallel ranks. `composed`: each block under activation checkpointing, the
    backend bucketing units' collectives, and each step two microbatches, the first under `no_sync`. `optim`: see
    `_optimizers`. `sequence_parallel`: `tp_plan(sequence_parallel=True)`."""
    if hybrid:
        mesh = init_device_mesh("cpu", (2, 2, world // 4), mesh_dim_names=("replicate", "shard", "tp"))
        dp_names, fsdp_mesh, strategy = ("replicate", "shard"), mesh["replicate", "shard"], "HYBRID_SHARD"
        data_rank, data_parts = 2 * mesh["replicate"].get_local_rank() + mesh["shard"].get_local_rank(), 4
    else:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        dp_names, fsdp_mesh, strategy = ("dp",), mesh["dp"], "FULL_SHARD"
        data_rank, data_parts = mesh["dp"].get_local_rank(), 2
    dp_rank, dp = mesh[dp_names[-1]].get_local_rank(), mesh[dp_names[-1]].size()  # the shard dimension
    torch.manual_seed(0)
    model = TinyTransformer()
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh["tp"], tp_plan(sequence_parallel))
    fsdp_graph.fully_shard(
        model,
        fsdp_mesh,
        strategy=fsdp_graph.ShardingStrategy[strategy],
        layout=layout,
        mixed_precision=BF16 if mp else None,
    )
    if break_reduce:
        from fsdp_graph.runtime.unit import flat_params

        for state in flat_params(model):
            state.divide_factor = 1.0  # the dp sum, not the mean: the gradients are twice too large
    model.checkpointed = composed
    run, backend = model, None
    if mode != "eager":
        backend = fsdp_graph.make_backend(inductor=mode == "inductor", bucket_bytes=1 << 20 if composed else 0)
        run = torch.compile(model, backend=backend, fullgraph=True)
    opt, ref_opt = _optimizers(model, ref, optim)
    gen = torch.Generator().manual_seed(7)
    out: dict[str, float] = {}
    for step in range(3):
        x, y = torch.randn(8, 6, 8, generator=gen), torch.randn(8, 6, 1, generator=gen)

        def train_step(x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            local_x, local_y = x.chunk(data_parts)[data_rank], y.chunk(data_parts)[data_rank]
            if not composed:
                nn.functional.mse_loss(run(local_x).float(), local_y).backward()
                return
            (first_x, second_x), (first_y, second_y) = local_x.chunk(2), local_y.chunk(2)
            with fsdp_graph.no_sync(model):  # accumulate locally, reduce with the second microbatch
                (0.5 * nn.functional.mse_loss(run(first_x).float(), first_y)).backward()
            (0.5 * nn.functional.mse_loss(run(second_x).float(), second_y)).backward()

        if step == 1:
            out.update({f"count_{k}": float(v) for k, v in executed_collectives(train_step).counts.items()})
        else:
            train_step()
        if mp:
            _bf16_reference_loss(
                ref, lambda call, batch: nn.functional.mse_loss(call(batch[0]).float(), batch[1]), (x, y)
            )
        else:
            nn.functional.mse_loss(ref(x), y).backward()
        if clip_norm_type is not None:
            norm = fsdp_graph.clip_grad_norm_(model, CLIP, clip_norm_type)
            ref_norm = nn.utils.clip_grad_norm_(ref.parameters(), CLIP, clip_norm_type)
            out["norm_diff"] = max(out.get("norm_diff", 0.0), abs(norm.item() - ref_norm.item()) / ref_norm.item())
            out["min_norm"] = min(out.get("min_norm", float("inf")), ref_norm.item())
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    from fsdp_graph.runtime.unit import flat_params

    specs = {}  # name: (tp spec or None, flat parameter state, slot)
    for state in flat_params(model):
        for slot, spec in zip(state.layout.slots, state.tp or [None] * len(state.layout.slots)):
            specs[slot.fqns[0]] = (spec, state, slot)
    params = dict(model.named_parameters())
    diffs = {
        n: _max_abs(_local(params[n]).detach() - expected_local(p, specs[n], dp_rank, dp))
        for n, p in ref.named_parameters()
    }
    out["max_diff"] = max(diffs.values())
    out["norm_max_diff"] = max(v for n, v in diffs.items() if ".norm" in n)
    out.update(_view_checks(model, ref, specs))
    out["graphs"] = float(backend.dynamo_graphs if backend else 0)
    if not composed:  # (after no_sync microbatches the checks' synced forward would compile a graph of its own)
        batch = (torch.randn(8, 6, 8, generator=gen), torch.randn(8, 6, 1, generator=gen))
        out.update(_grad_checks(model, run, ref, batch, data_parts, data_rank, mp))
    out.update(_state_dict_checks(model, ref, specs, dp_rank, dp, dp_names, sequence_parallel))
    out.update(_optim_state_dict_checks(model, ref, opt, ref_opt, specs, dp_rank, dp))
    out["tp_params"] = float(sum(spec is not None for spec, _, _ in specs.values()))
    out["foreach_by_default"] = float(torch_picks_foreach(model.parameters()))
    out["checked_graphs"] = float(backend.dynamo_graphs if backend else 0)
    if backend is not None:  # one compile per job (Inductor): graphs this rank compiled for all, or loaded
        out.update({f"shared_{k}": float(backend.sharing.stats[k]) for k in ("compiled", "loaded")})
    return out


def tp_fsdp_parity_cases(rank: int, world: int, cases: list[dict]) -> list[dict[str, float]]:
    """`tp_fsdp_parity(rank, world, **case)` for each case, in one launch (each launch costs seconds of process
    start and imports). Dynamo's caches are reset before each case, so each compiles from scratch, as alone."""
    results = []
    for case in cases:
        torch._dynamo.reset()
        results.append(tp_fsdp_parity(rank, world, **case))
    return results


def tp_fsdp2_interop(rank: int, world: int, direction: str, path: str) -> dict[str, float]:
    """DCP checkpoints between torch's FSDP2 + TP and ours on (dp=2, tp=2): one side (seed 0, trained one step)
    writes with plain `dcp.save`, the other (seed 7) reads with `dcp.load`; max |difference| of the full
    parameters before and after, and whether the two state dicts' placements agree."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    models = {}
    for side, seed in (("theirs", 0), ("ours", 7)) if direction == "fsdp2_to_ours" else (("ours", 0), ("theirs", 7)):
        torch.manual_seed(seed)
        model = TinyTransformer()
        parallelize_module(model, mesh["tp"], tp_plan())
        if side == "theirs":
            for block in model.blocks:
                fsdp2_fully_shard(block, mesh=mesh["dp"])
            fsdp2_fully_shard(model, mesh=mesh["dp"])
        else:
            fsdp_graph.fully_shard(model, mesh["dp"])
        models[side] = model
    writer, reader = (
        (models["theirs"], models["ours"])
        if direction == "fsdp2_to_ours"
        else (
            models["ours"],
            models["theirs"],
        )
    )
    gen = torch.Generator().manual_seed(3 + mesh["dp"].get_local_rank())
    opt = torch.optim.SGD(writer.parameters(), lr=0.1)
    nn.functional.mse_loss(writer(torch.randn(4, 6, 8, generator=gen)), torch.randn(4, 6, 1, generator=gen)).backward()
    opt.step()
    dcp.save({"model": writer.state_dict()}, checkpoint_id=path)
    before = max(
        (reader.state_dict()[k].full_tensor() - v.full_tensor()).abs().max().item()
        for k, v in writer.state_dict().items()
    )
    state = {"model": reader.state_dict()}
    dcp.load(state, checkpoint_id=path)
    reader.load_state_dict(state["model"])
    written, read = writer.state_dict(), reader.state_dict()
    return {
        "before_diff": before,
        "max_diff": max((read[k].full_tensor() - written[k].full_tensor()).abs().max().item() for k in written),
        "same_placements": float(
            all(
                tuple(read[k].placements) == tuple(written[k].placements)
                and read[k].device_mesh.mesh_dim_names == written[k].device_mesh.mesh_dim_names
                for k in written
            )
        ),
    }


# --- Hugging Face Llama with a hand-written TP plan (issue 14) ------------------------------------------------------

# The tiny Llama of tests/workers/hf_models.py: hidden 64, 2 layers, 4 heads of 16, 2 key/value heads,
# intermediate 128, vocab 256 (untied), fp32, on (dp=2, tp=2).
LLAMA_VOCAB, LLAMA_LAYERS, LLAMA_HIDDEN, LLAMA_HEADS, LLAMA_KV_HEADS, LLAMA_FFN = 256, 2, 64, 4, 2, 128
LLAMA_UNITS = ["model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head", ""]  # the default wrap policy


def _llama_local_shapes(tp: int) -> dict[str, list[tuple[int, ...]]]:
    """Each unit's tensor-parallel-LOCAL parameter shapes: Colwise (q, k, v, gate, up) split on dim 0, Rowwise (o,
    down) on dim 1, over tp; embedding, norms and head whole."""
    h, head_dim, ffn = LLAMA_HIDDEN, LLAMA_HIDDEN // LLAMA_HEADS, LLAMA_FFN
    q_out, kv_out = LLAMA_HEADS * head_dim, LLAMA_KV_HEADS * head_dim
    layer = [(q_out // tp, h), (kv_out // tp, h), (kv_out // tp, h), (h, q_out // tp)]  # q, k, v, o
    layer += [(ffn // tp, h), (ffn // tp, h), (h, ffn // tp), (h,), (h,)]  # gate, up, down, the two norms
    units = {"model.embed_tokens": [(LLAMA_VOCAB, h)], **{f"model.layers.{i}": layer for i in range(LLAMA_LAYERS)}}
    return {**units, "lm_head": [(LLAMA_VOCAB, h)], "": [(h,)]}


def llama_minimum_bytes(
    prepared: bool, batch: int, seq: int, dp: int = 2, tp: int = 2, element: int = 4
) -> dict[str, float]:
    """Bytes one rank sends per training step on each mesh dimension, derived from the shapes (ring algorithms:
    gathers and reduce-scatters send (n-1)/n of the payload, all-reduce 2(n-1)/n).

    dp (FULL_SHARD): each unit's flat parameter (the tp-local pieces, rows layout: every parameter padded to
    ceil(d0 / dp) rows per rank) gathered in forward and again in backward, except the embedding, whose backward
    reads no weight (its gradient is an index-add of the output gradient): one gather; one reduce-scatter each.

    tp (no sequence parallelism): forward, one all-reduce of the block output (batch, seq, hidden) per Rowwise layer
    (o_proj, down_proj: Partial -> Replicate); backward, one all-reduce of the input gradient per group of Colwise
    layers that read the same input DTensor (q/k/v, gate/up) when `prepared` (PrepareModuleInput made it once),
    else one per Colwise layer (q, k, v, gate, up: each ColwiseParallel wrapped the plain input itself)."""
    padded = {
        name: sum(-(-s[0] // dp) * dp * math.prod(s[1:]) for s in shapes)
        for name, shapes in _llama_local_shapes(tp).items()
    }
    total = sum(padded.values())
    ring = (dp - 1) / dp
    all_reduce = 2 * (tp - 1) / tp * batch * seq * LLAMA_HIDDEN * element
    per_layer = 2 + (2 if prepared else 5)
    return {
        "dp_gather": ring * element * (2 * total - padded["model.embed_tokens"]),
        "dp_reduce": ring * element * total,
        "tp": LLAMA_LAYERS * per_layer * all_reduce,
    }


def llama_tp_plan(prepare_inputs: bool = False) -> dict:
    """q/k/v/gate/up Colwise, o/down Rowwise (no sequence parallelism). HF's attention views its projections as
    `(*input_shape, -1, head_dim)`, so with Colwise q/k/v it sees the rank's local heads (2 query, 1 key/value head
    at tp=2; `num_key_value_groups` = 4 // 2 stays right) without touching the config.

    `prepare_inputs`: also make the attention's and the MLP's input a Replicate DTensor once
    (`PrepareModuleInput(..., use_local_output=False)`), so q/k/v (gate/up) share one DTensor input whose Partial
    gradients autograd adds before ONE all-reduce. Without it every ColwiseParallel wraps the plain input itself
    (`DTensor.from_local`), and each of those wraps all-reduces its own input gradient in backward."""
    from torch.distributed.tensor.parallel import PrepareModuleInput

    plan: dict = {}
    for i in range(LLAMA_LAYERS):
        layer = f"model.layers.{i}"
        plan.update({f"{layer}.self_attn.{n}_proj": ColwiseParallel() for n in ("q", "k", "v")})
        plan.update({f"{layer}.mlp.{n}_proj": ColwiseParallel() for n in ("gate", "up")})
        plan[f"{layer}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"{layer}.mlp.down_proj"] = RowwiseParallel()
        if prepare_inputs:
            # The decoder layer calls self_attn(hidden_states=...) by keyword and mlp(hidden_states) positionally.
            plan[f"{layer}.self_attn"] = PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Replicate()},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                use_local_output=False,
            )
            plan[f"{layer}.mlp"] = PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
            )
    return plan


def _llama_bytes(mesh, batch: dict, prepare_inputs: bool) -> dict:
    """One eager training step of a fresh tp + fsdp Llama under `wire_bytes_per_group`: the bytes this rank sent
    per kind on the dp and on the tp group, and the facts the expected numbers are derived from (the units'
    parameter names, the batch's activation shape)."""
    from fsdp_graph.planning.measure import wire_bytes_per_group
    from fsdp_graph.runtime.unit import flat_params
    from tests.workers.hf_models import build_hf

    torch.manual_seed(0)
    model = build_hf("llama", LLAMA_VOCAB)
    parallelize_module(model, mesh["tp"], llama_tp_plan(prepare_inputs))
    fsdp_graph.fully_shard(model, mesh["dp"])
    sent = wire_bytes_per_group(lambda: model(**batch).loss.backward())
    # By ranks, not by name: on gloo our collectives run on a copy of the dp group (runtime/gloo.py).
    roles = {tuple(dist.get_process_group_ranks(mesh[r].get_group())): r for r in ("dp", "tp")}
    out: dict = {}
    for group, kinds in sent.items():
        role = roles[tuple(dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(group)))]
        out.update({f"{role}_{kind}": out.get(f"{role}_{kind}", 0.0) + float(v) for kind, v in kinds.items()})
    out["units"] = [state.name for state in flat_params(model)]
    return out


def hf_llama_tp(rank: int, world: int, steps: int = 3) -> dict:
    """(dp=2, tp=2) on a tiny HF Llama: the plan above (by hand), then fully_shard over dp, compiled fullgraph with
    eager kernels; `steps` SGD-with-momentum steps, each dp rank on its half of the global batch (the tp ranks of
    a dp group on the same half), against single-process training on the whole batch. Then the bytes of one eager
    step per group, with and without the plan's PrepareModuleInput."""
    from tests.workers.hf_models import build_hf, make_batch

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    torch.manual_seed(0)
    model = build_hf("llama", LLAMA_VOCAB)
    ref = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    parallelize_module(model, mesh["tp"], llama_tp_plan())
    fsdp_graph.fully_shard(model, mesh["dp"])
    backend = fsdp_graph.make_backend(inductor=False)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (model, ref))
    gen = torch.Generator().manual_seed(1234)
    for _ in range(steps):
        full = make_batch(gen, 4 * dp)  # every 4 rows hold as many labels: the dp ranks' mean losses average right
        local = {k: v.chunk(dp)[dp_rank] for k, v in full.items()}
        compiled(**local).loss.backward()
        ref(**full).loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    from fsdp_graph.runtime.unit import flat_params

    specs = {}
    for state in flat_params(model):
        for slot, spec in zip(state.layout.slots, state.tp or [None] * len(state.layout.slots)):
            specs[slot.fqns[0]] = (spec, state, slot)
    params = dict(model.named_parameters())
    out: dict = {
        "max_diff": max(
            _max_abs(_local(params[n]).detach() - expected_local(p, specs[n], dp_rank, dp))
            for n, p in ref.named_parameters()
        ),
        "full_diff": max(
            _max_abs(p.full_tensor() - dict(ref.named_parameters())[n].detach())
            for n, p in params.items()
            if isinstance(p, DTensor)
        ),
        "param_change": max(_max_abs(p.detach() - initial[n]) for n, p in ref.named_parameters()),
        "tp_params": float(sum(spec is not None for spec, _, _ in specs.values())),
        "graphs": float(backend.dynamo_graphs),
    }
    batch = {k: v.chunk(dp)[dp_rank] for k, v in make_batch(torch.Generator().manual_seed(5), 4 * dp).items()}
    out["batch_shape"] = tuple(batch["input_ids"].shape)
    out["bytes"] = {prepare: _llama_bytes(mesh, batch, prepare) for prepare in (False, True)}
    return out
