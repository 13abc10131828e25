"""Re-created (written here) from torch's test_fully_shard_autograd.py (and its post-accumulate-grad hook tests),
issue 32. Same conventions as tests/workers/fsdp2_upstream_train.py."""

from __future__ import annotations

import collections
import copy
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.workers.upstream_common import (
    compiled,
    fully_shard,
    local,
    loss_diff,
    mlp,
    sharded_diff,
    transformer,
)


class DoubleLinear(nn.Module):
    """torch.testing._internal.common_fsdp.DoubleLinear's behaviour: two outputs, or an unused second linear."""

    def __init__(self, dim: int, use_second_linear: bool) -> None:
        super().__init__()
        self.lin1, self.lin2, self.relu = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.ReLU()
        self.use_second_linear = use_second_linear

    def forward(self, x):
        if self.use_second_linear:
            return self.relu(self.lin1(x)), self.relu(self.lin2(x))
        return self.relu(self.lin1(x))


def _global_batch_parity(build, shard, loss_of, rank, world, mode, steps=10) -> dict[str, float]:
    """test_fully_shard_autograd's loop: a global batch, each rank its slice; the reference sees the whole batch and
    divides its gradients by the world size; the sharded loss is all-reduced (partial -> replicated)."""
    torch.manual_seed(42)
    model = build()
    ref = copy.deepcopy(model)
    shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
    out = {"loss_diff": 0.0, "grad_diff": 0.0, "param_diff": 0.0}
    run = compiled(model, mode, out)
    torch.manual_seed(1)
    for step in range(steps):
        global_inp = torch.rand(world * 2, 24)
        loss = loss_of(run(global_inp[rank * 2 : (rank + 1) * 2].detach()), step)
        loss.backward()
        ref_loss = loss_of(ref(global_inp), step)
        ref_loss.backward()
        for p in ref.parameters():
            if p.grad is not None:
                p.grad.div_(world)
        replicated = loss.detach().clone()
        dist.all_reduce(replicated)
        out["loss_diff"] = max(out["loss_diff"], loss_diff(replicated, ref_loss))
        out["grad_diff"] = max(out["grad_diff"], sharded_diff(ref, model, grads=True))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=bool(step % 2))
        out["param_diff"] = max(out["param_diff"], sharded_diff(ref, model))
    return out


def unused_forward_output(rank: int, world: int, mode: str) -> dict[str, float]:
    """test_unused_forward_output: both outputs in the loss for 3 steps, then only the first; reshard T/F/2
    (compiled: True; each compile costs seconds)."""
    out: dict[str, float] = {}
    for raf in (True, False, 2) if mode == "eager" else (True,):

        def shard(model, raf=raf):
            fully_shard(model.lin1, reshard_after_forward=raf)
            fully_shard(model, reshard_after_forward=raf)

        def loss_of(outs, step):
            return (outs[0] * outs[1]).sum() if step < 3 else outs[0].sum()

        result = _global_batch_parity(lambda: DoubleLinear(24, True), shard, loss_of, rank, world, mode)
        out.update({f"{k}_{raf}": v for k, v in result.items()})
    return out


def unused_forward_module(rank: int, world: int, mode: str) -> dict[str, float]:
    """test_unused_forward_module: lin2 sharded but never called; reshard T/F/2 (compiled: True)."""
    out: dict[str, float] = {}
    for raf in (True, False, 2) if mode == "eager" else (True,):

        def shard(model, raf=raf):
            for m in (model.lin1, model.lin2, model):
                fully_shard(m, reshard_after_forward=raf)

        result = _global_batch_parity(lambda: DoubleLinear(24, False), shard, lambda o, s: o.sum(), rank, world, mode)
        out.update({f"{k}_{raf}": v for k, v in result.items()})
    return out


def nontensor_activations(rank: int, world: int, mode: str) -> dict[str, float]:
    """test_nontensor_activations: activations wrapped in list, namedtuple, tuple and dict between sharded modules."""
    NT = collections.namedtuple("NT", "x y")

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin1, self.lin2, self.relu = nn.Linear(24, 24), nn.Linear(24, 24), nn.ReLU()

        def _f(self, x):
            return self.relu(self.lin2(self.relu(self.lin1(x))))

        def forward(self, inp):
            if isinstance(inp, list):
                return [self._f(inp[0])]
            if isinstance(inp, NT):
                return NT(self._f(inp.x), inp.y)
            if isinstance(inp, tuple):
                return (self._f(inp[0]),)
            return {"x": self._f(inp["x"])}

    class To(nn.Module):
        def __init__(self, kind) -> None:
            super().__init__()
            self.kind = kind

        def forward(self, x):
            return {list: lambda: [x], NT: lambda: NT(x, torch.ones_like(x)), tuple: lambda: (x,), dict: lambda: {"x": x}}[self.kind]()

    class From(nn.Module):
        def forward(self, x):
            return x["x"] if isinstance(x, dict) else x[0]

    out: dict[str, float] = {}
    for kind in (list, NT, tuple, dict):

        def build(kind=kind):
            return nn.Sequential(To(kind), Block(), Block(), Block(), From())

        def shard(model):
            for m in model:
                fully_shard(m)
            fully_shard(model)

        result = _global_batch_parity(build, shard, lambda o, s: o.sum(), rank, world, mode)
        out.update({f"{k}_{kind.__name__}": v for k, v in result.items()})
    return out


def post_acc_grad_hook_runs(rank: int, world: int) -> dict[str, float]:
    """test_post_acc_grad_hook_runs: a user's post-accumulate-grad hook runs once per parameter."""
    counts: dict[str, int] = defaultdict(int)
    model = mlp(8)
    for m in (model.in_proj, model.out_proj, model):
        fully_shard(m)
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, name=name: counts.__setitem__(name, counts[name] + 1))
    model(torch.randn(2, 8)).sum().backward()
    names = {n for n, _ in model.named_parameters()}
    return {"all_ran": float(set(counts) == names), "once": float(all(c == 1 for c in counts.values()) and bool(counts))}


def post_acc_grad_hook_optim_parity(rank: int, world: int) -> dict[str, float]:
    """test_post_acc_grad_hook_optim_parity: an optimizer (and LR scheduler) per parameter stepped from the hook
    equals torch's FSDP2 with one optimizer; SGD with momentum for AdamW, 10 steps, exact."""
    torch.manual_seed(42)
    model, args = transformer(dropout_p=0.0)
    ref = copy.deepcopy(model)
    for m in [*ref.layers, ref]:
        torch.distributed.fsdp.fully_shard(m)
    kwargs = {"lr": 1e-2, "momentum": 0.9, "foreach": False}
    ref_opt = torch.optim.SGD(ref.parameters(), **kwargs)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=5)
    for m in [*model.layers, model]:
        fully_shard(m)
    optims = {p: torch.optim.SGD([p], **kwargs) for p in model.parameters()}
    scheds = {p: torch.optim.lr_scheduler.StepLR(o, step_size=5) for p, o in optims.items()}

    def hook(param):
        optims[param].step()
        optims[param].zero_grad()
        scheds[param].step()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    torch.manual_seed(42 + rank)
    inp = torch.randint(0, args.vocab_size, (2, 16))
    out = {"loss_diff": 0.0, "param_diff": 0.0}
    for _ in range(10):
        ref_loss = ref(inp).sum()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
        loss = model(inp).sum()
        loss.backward()
        out["loss_diff"] = max(out["loss_diff"], loss_diff(loss, ref_loss))
        out["param_diff"] = max(
            out["param_diff"], *((local(p) - local(q)).abs().max().item() for p, q in zip(ref.parameters(), model.parameters()))
        )
    return out


