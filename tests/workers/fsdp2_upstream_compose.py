"""Re-created (written here) from torch's test_fully_shard_training.py (composition: chunked heads, grouped calls,
gradient accumulation, 1F1B, double forwards) and test_fully_shard_autograd.py, issue 32. Same conventions as
tests/workers/fsdp2_upstream_train.py."""

from __future__ import annotations

import copy
import functools
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable import checkpoint
from torch.distributed.tensor.debug import CommDebugMode

from tests.workers.upstream_common import (
    average_grads,
    blocks_of,
    fully_shard,
    impl,
    local,
    loss_diff,
    mlp,
    sharded_diff,
    transformer,
)


class ChunkedHeadModel(nn.Module):
    def __init__(self, dim: int, vocab: int, tie: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim, bias=False)
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, tokens, *, skip_head: bool = False):
        h = self.norm(self.body(self.embed(tokens)))
        return h if skip_head else self.head(h)


def _chunked_model(tie: bool, ac: bool = False) -> ChunkedHeadModel:
    torch.manual_seed(42)
    model = ChunkedHeadModel(32, 128, tie)
    if ac:
        checkpoint(model.body)
    return model


def _shard_chunked(model: ChunkedHeadModel, grouped: bool, tie: bool, **options) -> None:
    if grouped and tie:
        fully_shard(model.body, **options)
        fully_shard([model.embed, model.norm, model.head], **options)
    else:
        fully_shard(model.embed, **options)
        fully_shard(model.body, **options)
        if grouped:
            fully_shard([model.norm, model.head], **options)
        else:
            fully_shard(model.norm, **options)
            fully_shard(model.head, **options)
    fully_shard(model, **options)


def _run_chunked(model, tokens, n_chunks: int, snapshot: bool = True):
    """The chunked-loss pattern: forward without the head, the head per chunk with its own backward, then the
    body's backward with the chunks' input gradients. Returns the loss, the whole head gradient, and whether every
    chunk added to it."""
    h = model(tokens, skip_head=True)
    grads, total, snapshots = [], 0.0, []
    for chunk in torch.chunk(h.detach().float(), n_chunks, dim=1):
        chunk = chunk.contiguous().requires_grad_(True)
        loss = model.head(chunk).sum()
        total += loss.item()
        loss.backward()
        grads.append(chunk.grad.detach())
        if snapshot:
            g = model.head.weight.grad
            snapshots.append(g.full_tensor() if hasattr(g, "full_tensor") else g.clone())
    h.backward(torch.cat(grads, dim=1).to(h.dtype))
    contributed = all((b - a).norm().item() > 0 for a, b in zip(snapshots, snapshots[1:]))
    return total, snapshots[-1] if snapshots else None, contributed


def partial_group_forward_then_standalone(rank: int, world: int) -> dict[str, float]:
    """test_partial_group_forward_then_standalone, mp_policy "none" (its bf16 modes need output_dtype: see
    partial_group_output_dtype): reshard T/F x weight tying, plus AC on the body and reshard 1; grouped vs ungrouped
    and vs the reference (DDP), 10 steps."""
    out: dict[str, float] = {}
    cases = [(raf, tie, False) for raf in (True, False) for tie in (False, True)] + [(True, False, True), (1, False, False)]
    for raf, tie, ac in cases:
        tag = f"{raf}_{tie}_{ac}"
        torch.manual_seed(42)
        tokens = torch.randint(0, 128, (2, 16))
        ref = _chunked_model(tie, ac)
        model = _chunked_model(tie, ac)
        _shard_chunked(model, True, tie, reshard_after_forward=raf)
        models = [(model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))]
        if not tie:
            ungrouped = _chunked_model(tie, ac)
            _shard_chunked(ungrouped, False, tie, reshard_after_forward=raf)
            models.append((ungrouped, torch.optim.SGD(ungrouped.parameters(), lr=1e-2, momentum=0.9)))
        ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
        worst = {"loss_diff": 0.0, "head_grad_diff": 0.0, "param_diff": 0.0, "grouping_diff": 0.0, "contributed": 1.0}
        for step in range(10):
            losses, heads = [], []
            for m, _ in models:
                loss, head, contributed = _run_chunked(m, tokens, 4)
                losses.append(loss)
                heads.append(head)
                worst["contributed"] = min(worst["contributed"], float(contributed))
            ref_loss, ref_head, _ = _run_chunked(ref, tokens, 4)
            average_grads(ref)
            dist.all_reduce(ref_head, op=dist.ReduceOp.AVG)
            worst["loss_diff"] = max(worst["loss_diff"], loss_diff(ref_loss, losses[0]))
            worst["head_grad_diff"] = max(worst["head_grad_diff"], (heads[0] - ref_head).abs().max().item())
            if len(models) == 2:
                worst["grouping_diff"] = max(worst["grouping_diff"], sharded_diff(models[1][0], models[0][0], grads=True))
            for o in [ref_opt] + [o for _, o in models]:
                o.step()
                o.zero_grad(set_to_none=step % 2 == 0)
            worst["param_diff"] = max(worst["param_diff"], sharded_diff(ref, model))
        out.update({f"{k}_{tag}": v for k, v in worst.items()})
    return out


def partial_group_output_dtype(rank: int, world: int) -> dict[str, float]:
    """test_partial_group_forward_then_standalone's bf16 modes: the grouped [norm, head] call with
    MixedPrecisionPolicy(param_dtype=fp32, output_dtype=bf16); the partial forward's and each chunk's outputs are
    bf16 (bf16_everywhere and bf16_inner_only)."""
    policy = impl().MixedPrecisionPolicy
    out: dict[str, float] = {}
    for name, inner, root in (
        ("everywhere", policy(param_dtype=torch.float32, output_dtype=torch.bfloat16), None),
        ("inner_only", policy(param_dtype=torch.float32, output_dtype=torch.bfloat16), policy(param_dtype=torch.float32)),
    ):
        root = root or inner
        model = _chunked_model(False)
        fully_shard(model.embed, mp_policy=root)
        fully_shard(model.body, mp_policy=root)
        fully_shard([model.norm, model.head], mp_policy=inner)
        fully_shard(model, mp_policy=root)
        h = model(torch.randint(0, 128, (2, 16)), skip_head=True)
        chunk_dtype = model.head(h.detach().float()[:, :4].contiguous()).dtype
        out[name] = float(h.dtype == torch.bfloat16 and chunk_dtype == torch.bfloat16)
    return out


def grouped_module_cast_forward_inputs(rank: int, world: int) -> dict[str, float]:
    """test_grouped_module_cast_forward_inputs: cast_forward_inputs applies to each module of a grouped call."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(32, 32, bias=False), nn.Linear(32, 32, bias=False)

        def forward(self, x):
            return self.b(self.a(x).float())

    policy = impl().MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=True)
    torch.manual_seed(42)
    model = Model()
    fully_shard([model.a, model.b], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    y = model(torch.randn(2, 32))
    y.sum().backward()
    return {"bf16": float(y.dtype == torch.bfloat16), "grads": float(all(p.grad is not None for p in model.parameters()))}


def partial_group_grad_accum_chunked(rank: int, world: int) -> dict[str, float]:
    """test_partial_group_forward_grad_accum_chunked: three micro-batches, head per chunk, gradient sync and
    is_last_backward only on the last; grouped [norm, head] gives the ungrouped model's gradients (reshard T/F)."""
    out: dict[str, float] = {}
    for raf in (True, False):
        models = []
        for grouped in (False, True):
            m = _chunked_model(False)
            _shard_chunked(m, grouped, False, reshard_after_forward=raf)
            models.append(m)
        tokens = [torch.randint(0, 128, (2, 16)) for _ in range(3)]
        for m in models:
            for i, t in enumerate(tokens):
                last = i == 2
                m.set_requires_gradient_sync(last)
                m.set_is_last_backward(last)
                _run_chunked(m, t, 2, snapshot=False)
        out[f"grad_diff_{raf}"] = max(
            (local(a.grad) - local(b.grad)).abs().max().item()
            for a, b in zip(models[0].parameters(), models[1].parameters())
        )
    return out


def partial_group_reshard_toggle(rank: int, world: int) -> dict[str, float]:
    """test_partial_group_reshard_toggle: reshard flags off for the chunk loop, restored, `head.reshard()`, then the
    body's backward; every parameter gets a gradient over 5 steps. Upstream's `param_group.is_unsharded` (private)
    is read here as: parameters are DTensors again after `reshard()` (public)."""
    out: dict[str, float] = {"grads": 1.0, "resharded": 1.0}
    for tie in (False, True):
        for initial in (False, True):
            model = _chunked_model(tie)
            if tie:
                fully_shard(model.body)
                fully_shard([model.embed, model.norm, model.head], reshard_after_forward=initial)
            else:
                fully_shard(model.embed)
                fully_shard(model.body)
                fully_shard([model.norm, model.head], reshard_after_forward=initial)
            fully_shard(model)
            opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
            tokens = torch.randint(0, 128, (2, 16))
            for step in range(5):
                h = model(tokens, skip_head=True)
                model.head.set_reshard_after_forward(False)
                model.head.set_reshard_after_backward(False)
                grads = []
                for chunk in torch.chunk(h.detach(), 4, dim=1):
                    chunk = chunk.contiguous().requires_grad_(True)
                    model.head(chunk).sum().backward()
                    grads.append(chunk.grad.detach())
                model.head.set_reshard_after_forward(True)
                model.head.set_reshard_after_backward(True)
                model.head.reshard()
                out["resharded"] = min(out["resharded"], float(all(hasattr(p, "full_tensor") for p in model.head.parameters())))
                h.backward(torch.cat(grads, dim=1).to(h.dtype))
                out["grads"] = min(out["grads"], float(all(p.grad is not None for p in model.parameters())))
                opt.step()
                opt.zero_grad(set_to_none=step % 2 == 0)
    return out


def reset_iter_state_after_exception(rank: int, world: int) -> dict[str, float]:
    """test_reset_iter_state_after_exception: a forward that raises mid-way, `reset_iter_state()`, then a full step."""

    class Raiser(nn.Module):
        def __init__(self, wrapped: nn.Module) -> None:
            super().__init__()
            self.wrapped, self.armed = wrapped, False

        def forward(self, x):
            if self.armed:
                raise RuntimeError("boom")
            return self.wrapped(x)

    model = _chunked_model(False)
    model.body = Raiser(model.body)
    fully_shard([model.norm, model.head])
    fully_shard(model)
    tokens = torch.randint(0, 128, (2, 16))
    model.body.armed = True
    try:
        model(tokens, skip_head=True)
        raised = 0.0
    except RuntimeError:
        raised = 1.0
    model.body.armed = False
    model.reset_iter_state()
    model(tokens).sum().backward()
    return {"raised": raised, "grads": float(all(p.grad is not None for p in model.parameters()))}


def double_forward_nested_checkpoint(rank: int, world: int) -> dict[str, float]:
    """test_double_forward_with_nested_fsdp_and_checkpoint: two forwards before one backward (DPO), nested calls on
    attention, feed-forward and block, composable or torch.utils checkpoint, reshard T/F."""
    out: dict[str, float] = {}
    for raf in (True, False):
        for impl_name in ("composable", "utils"):
            torch.manual_seed(42)
            model, _ = transformer(n_layers=3, n_heads=4, vocab_size=1024, max_seq_len=64, dropout_p=0,
                                   checkpoint_activations=impl_name == "utils")
            if impl_name == "composable":
                for block in blocks_of(model):
                    checkpoint(block)
            for layer in model.layers:
                fully_shard(layer.attention, reshard_after_forward=raf)
                fully_shard(layer.feed_forward, reshard_after_forward=raf)
                fully_shard(layer, reshard_after_forward=raf)
            fully_shard(model, reshard_after_forward=raf)
            torch.manual_seed(42 + rank)
            a, b = model(torch.randint(0, 1024, (2, 32))), model(torch.randint(0, 1024, (2, 32)))
            (a.sum() - b.sum()).pow(2).backward()
            out[f"{raf}_{impl_name}"] = float(all(p.grad is not None for p in model.parameters() if p.requires_grad))
    return out


def double_partial_forward_then_backward(rank: int, world: int) -> dict[str, float]:
    """test_double_partial_forward_then_backward: two partial forwards, one backward; the head has no gradient."""
    model = _chunked_model(False)
    fully_shard([model.norm, model.head])
    fully_shard(model)
    h1, h2 = model(torch.randint(0, 128, (2, 16)), skip_head=True), model(torch.randint(0, 128, (2, 16)), skip_head=True)
    (h1.sum() + h2.sum()).backward()
    params = dict(model.named_parameters())
    finite = all(params[n].grad is not None and torch.isfinite(local(params[n].grad)).all() for n in ("embed.weight", "norm.weight"))
    return {"finite": float(finite), "head_none": float(model.head.weight.grad is None)}


def _grad_acc_case(rank, world, raf, mode, rab, offload, counts: bool, steps: int = 5) -> dict[str, float]:
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(32, 32), *(mlp(32) for _ in range(3)))
    ref = copy.deepcopy(model)
    shard = functools.partial(fully_shard, reshard_after_forward=raf, offload_policy=offload)
    for m in model[1:]:
        shard(m)
    shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)

    def flags(last: bool) -> None:
        if mode == "all":
            model.set_requires_gradient_sync(last)
            if not rab:
                model.set_reshard_after_backward(last)
        elif mode == "some_mlps":
            for m in model[1:3]:
                m.set_requires_gradient_sync(last)
                if not rab:
                    m.set_reshard_after_backward(last)
        else:
            model.set_requires_gradient_sync(last, recurse=False)
            if not rab:
                model.set_reshard_after_backward(last, recurse=False)

    out = {"loss_diff": 0.0, "grad_diff": 0.0, "rs_ok": 1.0, "ag_ok": 1.0}
    torch.manual_seed(42 + rank + 1)
    for step in range(steps):
        totals: dict = defaultdict(int)
        for micro in range(3):
            flags(micro == 2)
            inp = torch.randn(2, 32)
            ref_loss = ref(inp).sum()
            ref_loss.backward()
            with CommDebugMode() as comm:
                loss = model(inp).sum()
                loss.backward()
            for op, n in comm.get_comm_counts().items():
                totals[op] += n
            out["loss_diff"] = max(out["loss_diff"], loss_diff(loss, ref_loss))
        c10d = torch.ops.c10d
        rs = 4 + {"some_mlps": 2 * 2, "root_only": 3 * 2}.get(mode, 0)
        ag = 4
        if raf is not False:
            ag = (ag + 4) * 3
        elif rab:
            ag *= 3
        elif mode == "root_only":
            ag += 3 * 2
        if raf is not False and impl() is not torch.distributed.fsdp:
            # documented difference (docs/migrating-from-fsdp2.md, CommDebugMode): the root's first Linear, whose
            # input needs no gradient, is read by no backward op, so it is not gathered again in backward: one
            # all-gather fewer per micro-batch than FSDP2
            ag -= 3
        out["rs_ok"] = min(out["rs_ok"], float(totals[c10d._reduce_scatter_base_] == rs))
        out["ag_ok"] = min(out["ag_ok"], float(totals[c10d._allgather_base_] == ag))
        average_grads(ref)
        out["grad_diff"] = max(out["grad_diff"], sharded_diff(ref, model, grads=True))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=bool(step % 2))
    if not counts:
        del out["rs_ok"], out["ag_ok"]
    return out


def _grad_acc_cases(modes):
    offloads = (impl().OffloadPolicy(), impl().CPUOffloadPolicy(pin_memory=False))
    for raf in (True, False, 2):
        for mode in modes:
            for rab in (False, True):
                for offload in offloads:
                    cpu = isinstance(offload, impl().CPUOffloadPolicy)
                    if (not rab and (raf is not False or mode == "some_mlps")) or (cpu and raf is not True):
                        continue
                    yield raf, mode, rab, offload, f"{raf}_{mode}_{rab}_{'cpu' if cpu else 'none'}"


def gradient_accumulation(rank: int, world: int, counts: bool = False) -> dict[str, float]:
    """test_gradient_accumulation, 1-D mesh (HSDP needs 4 ranks), mode "all" (the whole model switched; fsdp_graph
    refuses a partial switch: partial_gradient_sync): reshard T/F/2 x reshard_after_backward x CPU offload, 3
    micro-batches, 5 steps; losses and reduced gradients vs DDP. `counts`: CommDebugMode's reduce-scatter and
    all-gather counts as upstream computes them (2 steps: every step counts the same)."""
    out: dict[str, float] = {}
    for raf, mode, rab, offload, tag in _grad_acc_cases(("all",)):
        result = _grad_acc_case(rank, world, raf, mode, rab, offload, counts, steps=2 if counts else 5)
        out.update({f"{k}_{tag}": v for k, v in result.items()})
    return out


def gradient_accumulation_comm_counts(rank: int, world: int) -> dict[str, float]:
    return gradient_accumulation(rank, world, counts=True)


def partial_gradient_sync(rank: int, world: int) -> dict[str, float]:
    """test_gradient_accumulation's modes "root_only" and "some_mlps" (part of the model switched): parity vs DDP."""
    out: dict[str, float] = {}
    for raf, mode, rab, offload, tag in _grad_acc_cases(("root_only", "some_mlps")):
        out.update({f"{k}_{tag}": v for k, v in _grad_acc_case(rank, world, raf, mode, rab, offload, False).items()})
    return out


def one_f_one_b_microbatching(rank: int, world: int) -> dict[str, float]:
    """test_1f1b_microbatching: reshard_after_forward=False, optional explicit async `unshard()` of every module,
    3 micro-batches with sync only on the last, then one step; losses and sharded parameters vs the reference."""
    out: dict[str, float] = {}
    for explicit in (False, True):
        for rab in (False, True):
            torch.manual_seed(42)
            model, args = transformer(dropout_p=0.0)
            ref = copy.deepcopy(model)
            for block in blocks_of(model):
                fully_shard(block, reshard_after_forward=False)
            fully_shard(model, reshard_after_forward=False)
            opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
            torch.manual_seed(42 + rank + 1)
            inputs = [torch.randint(0, args.vocab_size, (2, 16)) for _ in range(3)]
            if explicit:
                for m in model.modules():
                    if isinstance(m, impl().FSDPModule):
                        m.unshard(async_op=True)
            diff = 0.0
            for i, inp in enumerate(inputs):
                last = i == 2
                model.set_requires_gradient_sync(last)
                model.set_is_last_backward(last)
                if not rab:
                    model.set_reshard_after_backward(last)
                loss, ref_loss = model(inp).sum(), ref(inp).sum()
                loss.backward()
                ref_loss.backward()
                diff = max(diff, loss_diff(loss, ref_loss))
            average_grads(ref)
            opt.step()
            ref_opt.step()
            out[f"loss_diff_{explicit}_{rab}"] = diff
            out[f"param_diff_{explicit}_{rab}"] = sharded_diff(ref, model)
    return out
