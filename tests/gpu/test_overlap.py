"""The schedule on a GPU. One GPU: Inductor's CUDA (Triton) code keeps the order of collectives, waits and matmuls
that `passes.schedule` produced (fake process group: it compiles real collectives but moves nothing, and a one-rank
NCCL group has no collective to order). Two GPUs: a prefetched NCCL all-gather runs while compute kernels do."""

import json
import socket

import pytest
import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
import torch.multiprocessing as mp
from torch._inductor.utils import run_and_get_code

import fsdp_graph
from tests.gpu.ranks import gather_overlap
from tests.graphs.test_inductor_order import FourBlock
from tests.workers.collective_order import code_sequence, fx_sequence, prefetched

pytestmark = pytest.mark.gpu


def test_inductor_on_cuda_keeps_the_scheduled_order(fake_pg):
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    # without shared block bodies, as tests/graphs/test_inductor_order.py: this checks each block's own nodes, and a
    # shared body would add its own forward and backward reports
    model = fsdp_graph.fully_shard(FourBlock().to(device), reuse_blocks=False)
    backend = fsdp_graph.make_backend(keep_graphs=True)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(8, 16, device=device)
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        _, codes = run_and_get_code(lambda: compiled(x).sum().backward())
    assert [r.stage for r in backend.reports] == ["fw", "bw"] and len(codes) == 2, (backend.reports, len(codes))
    assert any("triton" in code for code in codes)
    for report, code in zip(backend.reports, codes):
        scheduled = fx_sequence(report.graph)
        assert prefetched(scheduled), scheduled
        ran = code_sequence(code)
        assert ran == scheduled, f"{report.stage}: Inductor ran\n{ran}\nthe schedule was\n{scheduled}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: 2 GPUs")
def test_prefetched_gather_overlaps_compute(tmp_path):
    out = tmp_path / "rank0.json"
    mp.spawn(gather_overlap, args=(2, _free_port(), str(out)), nprocs=2)
    result = json.loads(out.read_text())
    assert result["prefetched"], result  # the forward graph issues a gather before the previous one's wait
    assert result["gathers"] > 0 and result["gather_us"] > 0, result
    assert result["overlap"] > 0, result  # some of the all-gather time has a compute kernel running beside it
