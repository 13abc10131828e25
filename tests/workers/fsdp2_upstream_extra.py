"""Re-created (written here) from torch's test_fully_shard_clip_grad_norm_.py and test_fully_shard_ignore_params.py,
issue 32. Same conventions as tests/workers/fsdp2_upstream_train.py."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from tests.workers.upstream_common import (
    average_grads,
    blocks_of,
    full,
    fully_shard,
    impl,
    loss_diff,
    sharded_diff,
    transformer,
)


def clip_grad_norm_1d(rank: int, world: int) -> dict[str, float]:
    """test_clip_grad_norm_1d: torch's Transformer, blocks and root sharded; norms 2, 1, inf, max_norm 1, 5 of 10 steps:
    gradients equal the reference's, every gradient's norm exceeds max_norm before clipping (not vacuous), the total
    norm equals the reference's with one all-reduce (CommDebugMode), every clipped gradient's norm is at most
    max_norm and changed. SGD with momentum for Adam."""
    from torch.distributed.tensor.debug import CommDebugMode

    out: dict[str, float] = {"grad_diff": 0.0, "norm_diff": 0.0, "not_vacuous": 1.0, "one_all_reduce": 1.0, "clipped": 1.0}
    for norm_type in (2.0, 1.0, float("inf")):
        torch.manual_seed(42)
        model, args = transformer(dropout_p=0.0)
        ref = copy.deepcopy(model)
        for m in [*blocks_of(model), model]:
            fully_shard(m)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
        vnorm = lambda g, n=norm_type: torch.linalg.vector_norm(g, ord=n).item()  # noqa: E731
        torch.manual_seed(42 + rank + 1)
        inp = torch.randint(0, args.vocab_size, (3, 16))
        for _ in range(5):
            for m, o in ((ref, ref_opt), (model, opt)):
                o.zero_grad()
                m(inp).sum().backward()
            average_grads(ref)
            out["grad_diff"] = max(out["grad_diff"], sharded_diff(ref, model, grads=True))
            ref_grads = [p.grad.detach().clone() for p in ref.parameters()]
            local_grads = [p.grad.to_local().detach().clone() for p in model.parameters()]
            out["not_vacuous"] = min(out["not_vacuous"], float(all(vnorm(g) > 1 for g in ref_grads + local_grads if g.numel())))
            ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=1, norm_type=norm_type)
            with CommDebugMode() as comm:
                total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1, norm_type=norm_type, foreach=True)
            out["norm_diff"] = max(out["norm_diff"], loss_diff(ref_total, total.full_tensor()))
            reduces = comm.get_comm_counts()[torch.ops.c10d_functional.all_reduce]
            out["one_all_reduce"] = min(out["one_all_reduce"], float(reduces == len(total.placements)))
            ok = all(vnorm(p.grad.to_local()) <= 1 + 1e-6 for p in model.parameters())
            ok = ok and all(not torch.equal(p.grad.to_local(), g) for p, g in zip(model.parameters(), local_grads) if torch.count_nonzero(g))
            out["clipped"] = min(out["clipped"], float(ok))
            ref_opt.step()
            opt.step()
    return out


def ddp_a_fsdp_b_ddp_c(rank: int, world: int) -> dict[str, float]:
    """test_ddp_A_fsdp_B_ddp_C: A(addend, B(lin_b, subtrahend, C(lin_c))); B and B.lin_b sharded with C's parameters
    ignored, then DDP over A ignoring what FSDP manages; against DDP over the same model, 3 steps, parameters equal
    (full) before and after each step. SGD with momentum for Adam."""
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.nn.parallel import DistributedDataParallel

    class C(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin_c = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin_c(x)

    class B(nn.Module):
        def __init__(self, subtrahend) -> None:
            super().__init__()
            self.lin_b, self.module_c, self.subtrahend = nn.Linear(8, 8), C(), nn.Parameter(subtrahend)

        def forward(self, x):
            return self.lin_b(self.module_c(x)) - self.subtrahend

    class A(nn.Module):
        def __init__(self, addend, subtrahend) -> None:
            super().__init__()
            self.module_b, self.addend = B(subtrahend), nn.Parameter(addend)

        def forward(self, x):
            return (self.module_b(x) + self.addend).sum()

    def make():
        torch.manual_seed(42)
        addend = torch.randn(8, 8)
        torch.manual_seed(70)
        subtrahend = torch.randn(8, 8)
        model = A(addend, subtrahend)
        torch.manual_seed(84)
        return model, torch.randn(8, 8)

    ref, ref_inp = make()
    ref = DistributedDataParallel(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
    ref_params = dict(ref.named_parameters())
    model, inp = make()
    ignored = set(model.module_b.module_c.parameters())
    fully_shard(model.module_b.lin_b, ignored_params=ignored)
    fully_shard(model.module_b, ignored_params=ignored)
    out = {"fsdp_modules": float({n for n, m in model.named_modules() if isinstance(m, impl().FSDPModule)} == {"module_b", "module_b.lin_b"})}
    ddp_ignored = ["module_b.subtrahend", "module_b.lin_b.weight", "module_b.lin_b.bias"]  # FSDP's, not ignored by it
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module=model, params_and_buffers_to_ignore=ddp_ignored)
    model = DistributedDataParallel(model, broadcast_buffers=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    params = dict(model.named_parameters())

    def diff() -> float:
        return max((full(params[n].detach()) - p.detach()).abs().max().item() for n, p in ref_params.items())

    out["param_diff"], out["loss_diff"] = diff(), 0.0
    for _ in range(3):
        ref_loss, loss = ref(ref_inp), model(inp)
        out["loss_diff"] = max(out["loss_diff"], loss_diff(ref_loss, loss))
        ref_loss.backward()
        loss.backward()
        with implicit_replication():
            for o in (ref_opt, opt):
                o.step()
                o.zero_grad()
            out["param_diff"] = max(out["param_diff"], diff())
    return out
