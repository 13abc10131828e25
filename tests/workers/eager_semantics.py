"""Rank-side checks of issue 32's eager semantics on `fsdp_graph.fsdp2`, against torch's FSDP2 on the same code
(written here): activation checkpointing through torch's own wrappers, a grouped head run chunk by chunk under
gradient accumulation, users' post-accumulate-grad hooks. One spawn runs them all; each check's result is a dict of
floats under its name (an exception is recorded as `error`: every check raises symmetrically on both ranks)."""

from __future__ import annotations

import collections
import copy
import time
import traceback
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer, TransformerBlock

import fsdp_graph
from fsdp_graph import fsdp2
from fsdp_graph.ir.comm_debug import FSDP2_OPS

MODES = ("eager", "compiled")
VOCAB = 64


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _compiled(model: nn.Module, mode: str, fullgraph: bool = True) -> Callable:
    if mode == "eager":
        return model
    torch._dynamo.reset()
    return torch.compile(model, backend=fsdp_graph.make_backend(inductor=False), fullgraph=fullgraph)


def _max_diff(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    if mine.keys() != theirs.keys():
        return float("inf")
    return max((_local(mine[n]) - _local(theirs[n])).abs().max().item() for n in mine)


def _named(model: nn.Module, what: Callable[[nn.Parameter], torch.Tensor]) -> dict[str, torch.Tensor]:
    """By FQN without checkpoint wrappers' prefix (the wrapper adds one to every name inside it)."""
    return {n.replace("_checkpoint_wrapped_module.", ""): what(p).detach().clone() for n, p in model.named_parameters()}


# --- activation checkpointing (issue 32 items 1, 3, 4) ------------------------------------------------------------


def _transformer(impl: str, tied: bool) -> Transformer:
    """torch's test Transformer, checkpointed per block by `impl`: torch's CheckpointWrapper ("wrapper", what
    torchtune's set_activation_checkpointing applies), torch.utils.checkpoint inside the blocks' forward ("utils"),
    or torch.distributed._composable.checkpoint ("composable")."""
    torch.manual_seed(42)
    args = ModelArgs(
        n_layers=2, n_heads=4, dim=16, vocab_size=VOCAB, max_seq_len=16, dropout_p=0.0,
        checkpoint_activations=impl == "utils", weight_tying=tied,
    )  # fmt: skip
    model = Transformer(args)
    if impl == "wrapper":
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, TransformerBlock))
    elif impl == "composable":
        for module in model.modules():
            if isinstance(module, TransformerBlock):
                composable_checkpoint(module)
    return model


def _shard_transformer(model: Transformer, fully_shard: Callable, grouping: str, reshard: bool) -> None:
    """The upstream test's groupings: a unit per block ("block"), or list units ("mem_eff": both layers as one,
    embeddings as one, norm and output as one)."""
    if grouping == "mem_eff":
        fully_shard([model.layers[0], model.layers[1]], reshard_after_forward=reshard)
        fully_shard([model.tok_embeddings, model.pos_embeddings], reshard_after_forward=reshard)
        fully_shard([model.norm, model.output], reshard_after_forward=reshard)
    else:
        for layer in model.layers:
            fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)


def checkpointed_parity(rank: int, world: int, impl: str, grouping: str, mode: str, steps: int = 5) -> dict[str, float]:
    """5 SGD-momentum steps of the same checkpointed model under torch's FSDP2 (eager) and `fsdp2` (`mode`): the
    largest loss, gradient and parameter differences over the steps (the first step's apart: an eager gather cache
    kept past the backward's recompute only shows from the second step on)."""
    tied = grouping != "mem_eff"
    ours, theirs = _transformer(impl, tied), _transformer(impl, tied)
    _shard_transformer(ours, fsdp2.fully_shard, grouping, reshard=True)
    _shard_transformer(theirs, torch_fully_shard, grouping, reshard=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    run = _compiled(ours, mode)
    gen = torch.Generator().manual_seed(1)
    out = {"loss_diff_first": 0.0, "grad_diff_first": 0.0, "loss_diff": 0.0, "grad_diff": 0.0}
    for step in range(steps):
        tokens = torch.randint(0, VOCAB, (2 * world, 16), generator=gen).chunk(world)[rank]
        losses = [forward(tokens).float().pow(2).mean() for forward in (run, theirs)]
        for loss in losses:
            loss.backward()
        suffix = "_first" if step == 0 else ""
        out[f"loss_diff{suffix}"] = max(out[f"loss_diff{suffix}"], abs(losses[0].item() - losses[1].item()))
        grads = _max_diff(_named(ours, lambda p: p.grad), _named(theirs, lambda p: p.grad))
        out[f"grad_diff{suffix}"] = max(out[f"grad_diff{suffix}"], grads)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 0)
    out["param_diff"] = _max_diff(_named(ours, lambda p: p), _named(theirs, lambda p: p))
    return out


# --- a grouped head run chunk by chunk under gradient accumulation (issue 32 item 2) -----------------------------


class ChunkedHead(nn.Module):
    """The upstream test's model: `forward(skip_head=True)` stops before the head, which the loss then runs on
    chunks of the hidden states."""

    def __init__(self, dim: int = 32, vocab: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim, bias=False)
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        hidden = self.norm(self.body(self.embed(tokens)))
        return hidden if skip_head else self.head(hidden)


def chunked_head_accumulation(rank: int, world: int, mode: str) -> dict[str, float]:
    """`fully_shard([norm, head])`; three microbatches with `set_requires_gradient_sync(is_last)` and
    `set_is_last_backward(is_last)`; each runs the model without its head, the head on two chunks of the hidden
    states (a backward each), then the backward of the hidden states. The accumulated gradients against torch's
    FSDP2 on the same calls, for reshard_after_forward True and False (compiled: the model's forward compiled, the
    head's chunks eager, as `model.head(...)` is called on the module; True only)."""
    out = {}
    gen = torch.Generator().manual_seed(rank + 1)
    microbatches = [torch.randint(0, 128, (2, 16), generator=gen) for _ in range(3)]
    for reshard in (True, False) if mode == "eager" else (True,):
        models = []
        for fully_shard in (fsdp2.fully_shard, torch_fully_shard):
            torch.manual_seed(42)
            model = ChunkedHead()
            fully_shard(model.embed, reshard_after_forward=reshard)
            fully_shard(model.body, reshard_after_forward=reshard)
            fully_shard([model.norm, model.head], reshard_after_forward=reshard)
            fully_shard(model, reshard_after_forward=reshard)
            models.append(model)
        for model, forward in zip(models, (_compiled(models[0], mode), models[1])):
            for i, tokens in enumerate(microbatches):
                last = i == len(microbatches) - 1
                model.set_requires_gradient_sync(last)
                model.set_is_last_backward(last)
                hidden = forward(tokens, skip_head=True)
                hidden_grads = []
                for chunk in hidden.detach().chunk(2, dim=1):
                    chunk = chunk.contiguous().requires_grad_(True)
                    model.head(chunk).sum().backward()
                    hidden_grads.append(chunk.grad)
                hidden.backward(torch.cat(hidden_grads, dim=1))
        out[f"grad_diff_{reshard}"] = _max_diff(*(_named(m, lambda p: p.grad) for m in models))
    return out


# --- users' post-accumulate-grad hooks (issue 32 item 5) ---------------------------------------------------------


class MLP(nn.Module):
    """torch's common_fsdp MLP (in_proj, relu, out_proj)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(x)))


def _is_shard_of(grad: torch.Tensor | None, param: torch.Tensor) -> bool:
    return isinstance(grad, DTensor) and grad.placements == param.placements and grad.to_local().shape == (
        param.to_local().shape
    )


def post_acc_grad_hooks(rank: int, world: int, mode: str) -> dict[str, float]:
    """`register_post_accumulate_grad_hook` on each sharded parameter, one counting its calls and one stepping the
    parameter's own SGD-momentum optimizer (upstream test_post_acc_grad_hook_runs and
    test_post_acc_grad_hook_optim_parity): two steps, then a microbatch with gradient sync off and one with it on.
    Each hook runs once per backward that reduces (none while sync is off), with `.grad` the sharded DTensor
    gradient, accumulated; the parameters equal torch's FSDP2 stepped normally after each step."""
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    for m, fully_shard in ((model, fsdp2.fully_shard), (ref, torch_fully_shard)):
        fully_shard(m.in_proj)
        fully_shard(m.out_proj)
        fully_shard(m)
    calls: collections.Counter = collections.Counter()
    sharded = []
    optimizers = {p: torch.optim.SGD([p], lr=0.05, momentum=0.9) for p in model.parameters()}

    def hook(name: str, param: torch.Tensor) -> None:
        calls[name] += 1
        sharded.append(_is_shard_of(param.grad, param))
        optimizers[param].step()
        optimizers[param].zero_grad()

    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, name=name: hook(name, p))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    run = _compiled(model, mode)
    gen = torch.Generator().manual_seed(rank)
    names = {n for n, _ in model.named_parameters()}
    out = {"param_diff": 0.0, "once_each": 1.0}
    for syncs in ((True,), (True,), (False, True)):
        for sync in syncs:
            calls.clear()
            model.set_requires_gradient_sync(sync)
            ref.set_requires_gradient_sync(sync)
            x = torch.randn(3, 8, generator=gen)
            run(x).sum().backward()
            ref(x).sum().backward()
            if not sync:
                out["none_without_sync"] = float(not calls)
            elif set(calls) != names or set(calls.values()) != {1}:
                out["once_each"] = 0.0
        ref_opt.step()
        ref_opt.zero_grad()
        out["param_diff"] = max(out["param_diff"], _max_diff(_named(model, lambda p: p), _named(ref, lambda p: p)))
    out["sharded_grad"] = float(all(sharded))
    out["grads_cleared"] = float(all(p.grad is None for p in model.parameters()))
    return out


# --- torch's CommDebugMode (issue 32 item 7) ----------------------------------------------------------------------


def _comm_counts(comm: CommDebugMode) -> collections.Counter:
    counts = comm.get_comm_counts()
    return collections.Counter({kind: counts.get(op._overloadpacket, 0) for kind, op in FSDP2_OPS.items()})


def comm_debug_counts(rank: int, world: int) -> dict[str, float]:
    """torch's test_gradient_accumulation loop (a Linear and 3 MLP units, 3 microbatches with
    `set_requires_gradient_sync(is_last)`, optionally `set_reshard_after_backward(is_last)`), each microbatch's
    forward and backward under CommDebugMode, on `fsdp2` and on torch's FSDP2: the counts of FSDP2's c10d
    collectives per step, both sides, and the accumulated gradients' difference."""
    out: dict[str, float] = {}
    for reshard_after_forward, reshard_after_backward in ((True, True), (False, True), (False, False)):
        models = []
        for fully_shard in (fsdp2.fully_shard, torch_fully_shard):
            torch.manual_seed(42)
            model = nn.Sequential(nn.Linear(16, 16), *(MLP(16) for _ in range(3)))
            for mlp in model[1:]:
                fully_shard(mlp, reshard_after_forward=reshard_after_forward)
            fully_shard(model, reshard_after_forward=reshard_after_forward)
            models.append(model)
        key = f"{reshard_after_forward}_{reshard_after_backward}"
        gen = torch.Generator().manual_seed(rank)
        batches = [torch.randn(2, 16, generator=gen) for _ in range(3)]
        for side, model in zip(("ours", "fsdp2"), models):
            total: collections.Counter = collections.Counter()
            for i, x in enumerate(batches):
                last = i == len(batches) - 1
                model.set_requires_gradient_sync(last)
                if not reshard_after_backward:
                    model.set_reshard_after_backward(last)
                with CommDebugMode() as comm:
                    model(x).sum().backward()
                total += _comm_counts(comm)
            for kind in FSDP2_OPS:
                out[f"{side}_{kind}_{key}"] = float(total[kind])
        out[f"grad_diff_{key}"] = _max_diff(*(_named(m, lambda p: p.grad) for m in models))
    # HSDP on a (2 replicas, 1 shard) mesh: the replica all-reduces (no reduce-scatter or gather at shard size 1).
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    models = []
    for fully_shard in (fsdp2.fully_shard, torch_fully_shard):
        torch.manual_seed(42)
        model = nn.Sequential(*(MLP(16) for _ in range(2)))
        for mlp in model:
            fully_shard(mlp, mesh=mesh)
        models.append(fully_shard(model, mesh=mesh))
    fsdp2.shard_pending()  # (a first forward under CommDebugMode that shards confuses its module tracker)
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(rank))
    for side, model in zip(("ours", "fsdp2"), models):
        with CommDebugMode() as comm:
            model(x).sum().backward()
        for kind, count in _comm_counts(comm).items():
            out[f"{side}_{kind}_hsdp"] = float(count)
    out["grad_diff_hsdp"] = _max_diff(*(_named(m, lambda p: p.grad) for m in models))
    return out


# --- FSDP2's registered parameters after forward (issue 32 item 6) ------------------------------------------------


def _kinds(params) -> str:
    """"D" per DTensor parameter (sharded), "t" per plain tensor (unsharded)."""
    return "".join("D" if isinstance(p, DTensor) else "t" for p in params)


def param_registration(rank: int, world: int) -> dict[str, float]:
    """Upstream test_param_registration_after_forward/_after_backward at world 2 (its reshard_after_forward=2 is
    True here): which parameters are DTensors after the calls, after a forward, after `reshard()`, after a forward
    and backward, on `fsdp2` and on torch's FSDP2; and whether the unsharded ones equal the model's full values."""
    out: dict[str, float] = {}
    x = torch.randn(2, 3)
    for reshard in (True, False, None):
        seen = []
        for fully_shard in (fsdp2.fully_shard, torch_fully_shard):
            torch.manual_seed(42)
            model = nn.Sequential(MLP(3), MLP(3))
            full = [p.detach().clone() for p in model.parameters()]
            fully_shard(model[0].in_proj, reshard_after_forward=reshard)
            fully_shard(model[0].out_proj, reshard_after_forward=reshard)
            fully_shard(model, reshard_after_forward=reshard)
            kinds = [_kinds(model.parameters())]
            loss = model(x).sum()
            kinds.append(_kinds(model.parameters()))
            values = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
            kinds.append("=" if all(torch.equal(v, f) for v, f in zip(values, full)) else "!")
            loss.backward()
            kinds.append(_kinds(model.parameters()))
            model(x)
            for module in model.modules():
                if isinstance(module, fsdp2.FSDPModule):
                    module.reshard()
            kinds.append(_kinds(model.parameters()))
            seen.append(" ".join(kinds))
        out[f"same_as_fsdp2_{reshard}"] = float(seen[0] == seen[1])
        out[f"unsharded_after_forward_{reshard}"] = float("t" in seen[0].split()[1])
    return out


CHECKS: dict[str, Callable[..., dict[str, float]]] = {  # eager and compiled
    "composable_block": lambda rank, world, mode: checkpointed_parity(rank, world, "composable", "block", mode),
    "chunked_head": chunked_head_accumulation,
    "post_acc_grad_hooks": post_acc_grad_hooks,
}
# Eager only: compiled, a CheckpointWrapper and torch.utils.checkpoint are the region composable_block[compiled]
# runs (composable checkpoint becomes torch.utils.checkpoint); each compiled check costs a compile.
EAGER_ONLY: dict[str, Callable[..., dict[str, float]]] = {
    "wrapper_block": lambda rank, world: checkpointed_parity(rank, world, "wrapper", "block", "eager"),
    "wrapper_mem_eff": lambda rank, world: checkpointed_parity(rank, world, "wrapper", "mem_eff", "eager"),
    "utils_block": lambda rank, world: checkpointed_parity(rank, world, "utils", "block", "eager"),
    "comm_debug_counts": comm_debug_counts,
    "param_registration": param_registration,
}


def eager_semantics_checks(rank: int, world: int, only: tuple[str, ...] = ()) -> dict[str, dict[str, float | str]]:
    """Every check (`only`: those named), each result with the seconds it took under `seconds`."""
    results: dict[str, dict[str, float | str]] = {}
    runs = [(f"{name}[{mode}]", check, (mode,)) for mode in MODES for name, check in CHECKS.items()]
    runs += [(name, check, ()) for name, check in EAGER_ONLY.items()]
    for name, check, args in runs:
        if only and name.split("[")[0] not in only:
            continue
        start = time.perf_counter()
        results[name] = _recorded(check, rank, world, *args)
        results[name]["seconds"] = time.perf_counter() - start
    return results


def _recorded(check: Callable[..., dict[str, float]], *args) -> dict[str, float | str]:
    try:
        return check(*args)
    except Exception:  # recorded for the test that owns this check
        return {"error": traceback.format_exc(limit=8)}
    finally:
        fsdp2.calls._PENDING.clear()  # a failed check's calls must not shard with the next check's
