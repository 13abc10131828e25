"""Training on one GPU under a one-rank NCCL group: Inductor (Triton) parity with single-process training, and
CPU offload with CUDA compute. World 1 has nothing to communicate; these check the CUDA data path."""

import copy

import pytest
import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch._inductor.utils import run_and_get_code

import fsdp_graph
from tests.workers.training import build

pytestmark = pytest.mark.gpu


def _train_side_by_side(model, compiled, ref, loss_fn, make_batch, device, steps: int = 4, after_backward=None):
    """SGD steps with gradient clipping on the sharded model and on the reference. Returns the (loss, reference
    loss) pairs and the code Inductor generated at the first step; `after_backward(model)` runs before each
    optimizer step. The caches are off, so our passes run and the code is generated here."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1234)
    losses, codes = [], []
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        for step in range(steps):
            batch = tuple(t.to(device) for t in make_batch(gen, 8))
            if step == 0:
                loss, codes = run_and_get_code(lambda b=batch: loss_fn(compiled, b))
            else:
                loss = loss_fn(compiled, batch)
            loss.backward()
            if after_backward is not None:
                after_backward(model)
            fsdp_graph.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()
            ref_loss = loss_fn(ref, batch)
            ref_loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
            losses.append((loss.item(), ref_loss.item()))
    return losses, codes


def _max_param_diff(model, ref) -> float:
    """Max abs difference between the sharded model's full parameters and the reference's, on the CPU."""
    full = fsdp_graph.full_state_dict(model)
    ref_sd = ref.state_dict()
    assert set(full) == set(ref_sd), set(full) ^ set(ref_sd)
    return max((full[k].detach().cpu() - ref_sd[k].detach().cpu()).abs().max().item() for k in ref_sd)


def _assert_parity(losses: list[tuple[float, float]]) -> None:
    for ours, reference in losses:
        assert ours == pytest.approx(reference, rel=1e-4, abs=1e-5), losses
    assert losses[-1][1] < losses[0][1], losses  # training moved: parity is not vacuous


def test_world1_nccl_inductor_matches_single_process(nccl_world1):
    device = nccl_world1
    torch.manual_seed(0)
    model, loss_fn, make_batch = build("gpt")
    model.to(device)
    ref = copy.deepcopy(model)
    fsdp_graph.fully_shard(model)
    assert all(p.device == device for p in model.parameters())
    backend = fsdp_graph.make_backend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    losses, codes = _train_side_by_side(model, compiled, ref, loss_fn, make_batch, device)
    assert any("triton" in code for code in codes), "Inductor generated no Triton kernel"
    # compiled by our passes: the model's forward and backward, and a shared block body's (reuse_blocks) of each
    assert {r.stage for r in backend.reports} == {"fw", "bw"}, backend.reports
    _assert_parity(losses)
    assert _max_param_diff(model, ref) < 1e-4


def test_cpu_offload_with_cuda_compute(nccl_world1):
    """Shards and gradients stay in (pinned) CPU memory, gathers and compute run on the GPU, the numerics equal
    single-process training on the GPU, and the GPU keeps no parameter between steps."""
    device = nccl_world1
    torch.manual_seed(0)
    model, loss_fn, make_batch = build("gpt")
    ref = copy.deepcopy(model).to(device)
    param_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    before = torch.cuda.memory_allocated(device)  # the reference's parameters are in it
    fsdp_graph.fully_shard(model, cpu_offload=fsdp_graph.CPUOffload(offload_params=True), device=device)
    states = model._fsdp_root.flat_params
    assert all(s.flat_shard.device.type == "cpu" and s.flat_shard.is_pinned() for s in states)
    assert all(s.compute_device == device for s in states)
    compiled = torch.compile(model, backend=fsdp_graph.make_backend(), fullgraph=True)

    def grads_on_cpu(m):
        assert all(p.grad is not None and p.grad.device.type == "cpu" for p in m.parameters())

    losses, codes = _train_side_by_side(model, compiled, ref, loss_fn, make_batch, device, 3, grads_on_cpu)
    assert any("triton" in code for code in codes), "Inductor generated no Triton kernel"
    _assert_parity(losses)
    assert _max_param_diff(model, ref) < 1e-4
    ref.cpu()
    kept = torch.cuda.memory_allocated(device) - (before - param_bytes)  # the reference has left the GPU
    assert kept < param_bytes / 4, (kept, param_bytes)
