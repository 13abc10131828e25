"""Inductor runs the collectives in the order `passes.schedule` gave them (fake process group, world 4).

Inductor's `reorder_for_peak_memory` re-sorts its scheduler nodes and, left on, undid every forward prefetch of
the model below (docs/design-notes.md, "Inductor keeps our schedule"); the backend turns it off."""

import pytest
import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
import torch.nn as nn
from torch._inductor.utils import run_and_get_code

import fsdp_graph
from tests.workers.collective_order import code_sequence, fx_sequence, prefetched


class FourBlock(nn.Module):
    """Four linear blocks and a head: five units, enough for the schedule to prefetch in both directions."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(4))
        self.head = nn.Linear(dim, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


_CODE = """\
def call(args):
    buf0 = torch.ops._c10d_functional.all_gather_into_tensor.default(primals_2, 4, '0')
    assert_size_stride(buf0, (272, ), (1, ), 'torch.ops._c10d_functional.all_gather_into_tensor.default')
    torch.ops._c10d_functional.all_gather_into_tensor_out.default(primals_3, 4, '0', out=buf1)
    torch.ops._c10d_functional.wait_tensor.default(buf0)
    extern_kernels.addmm(reinterpret_tensor(buf0, (16, ), (1, ), 256), primals_1, buf0, alpha=1, beta=1, out=buf4)
    cpp_fused_relu_0(buf6)
    buf7 = torch.ops._c10d_functional.reduce_scatter_tensor.default(buf6, 'sum', 4, '0')
    torch.ops._c10d_functional.wait_tensor.default(buf1)
    extern_kernels.mm(buf6, buf1, out=buf8)
    torch.ops._c10d_functional.wait_tensor.default(buf7)
"""


def test_code_sequence_reads_issues_waits_and_matmuls():
    assert code_sequence(_CODE) == [
        "all_gather_into_tensor#0",
        "all_gather_into_tensor#1",
        "wait(all_gather_into_tensor#0)",
        "mm",
        "reduce_scatter_tensor#0",
        "wait(all_gather_into_tensor#1)",
        "mm",
        "wait(reduce_scatter_tensor#0)",
    ]
    assert prefetched(code_sequence(_CODE))
    assert not prefetched(["all_gather_into_tensor#0", "wait(all_gather_into_tensor#0)", "mm"])


@pytest.mark.slow
def test_inductor_keeps_the_scheduled_collective_order(fake_pg):
    torch.manual_seed(0)
    # without shared block bodies (the default since issue 25): this checks each block's own nodes
    model = fsdp_graph.fully_shard(FourBlock(), reuse_blocks=False)
    backend = fsdp_graph.make_backend(keep_graphs=True)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(8, 16)
    # A cache hit would skip our pass, and with it the graphs this test compares against.
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        _, codes = run_and_get_code(lambda: compiled(x).sum().backward())
    stages = [report.stage for report in backend.reports]
    assert stages == ["fw", "bw"] and len(codes) == 2, (stages, len(codes))
    for report, code in zip(backend.reports, codes):
        scheduled = fx_sequence(report.graph)
        assert prefetched(scheduled), scheduled  # otherwise there is nothing Inductor could undo
        ran = code_sequence(code)
        assert ran == scheduled, f"{report.stage}: Inductor ran\n{ran}\nthe schedule was\n{scheduled}"
