"""What torch 2.13 makes of a complex RoPE cache inside a `nested_compile_region`: the two faults that
`passes.materialize_conjugates` and `block_region.keep_complex_bodies_exact` work around so that `fully_shard`'s
blocks holding complex tensors share a body. Printed as facts. Plain torch, no fsdp_graph: one process, CPU, three
blocks with torchtitan's `ComplexRoPE` arithmetic (a complex64 cache buffer per block, sliced to the sequence,
multiplied into `view_as_complex` queries and keys).

    python benchmarks/complex_region_probe.py

For each backend (`aot_eager`, `inductor`), with and without the region, with the region plus a joint-graph
rewrite of `aten._conj` into `aten.conj_physical`, and with Dynamo's inlining of single-use bodies off as well: the
largest gradient difference from eager, or the error. The region's partitioned forward saves `_conj` of the cache
slice (a lazy-conjugate view) for its backward, and the invoke_subgraph HOP has no kernel for the Conjugate dispatch
key such a tensor carries. The rewrite (the same values, materialised) is exact with eager kernels, but under
Inductor the gradients are then silently wrong (9.6e-2 here) in the first block, whose call differs from the others
(its input needs no gradient), so Dynamo inlines it as a body used once (`inline_single_use_invoke_subgraph`). With
that inlining off as well, Inductor is right (the last row): what the library does. A torch that fixes both faults
makes the second and third rows right, and the workarounds can go. docs/design-notes.md ("Complex tensors in the
body") has the measurements.
"""

from __future__ import annotations

import copy
import os
import tempfile

import torch
import torch._inductor.config as inductor_config
import torch.nn as nn
from torch._inductor.custom_graph_pass import CustomGraphPass


class Rope(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(64).float(), 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))
        self.register_buffer("cache", torch.polar(torch.ones_like(freqs), freqs), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq = q.shape[1]
        cache = self.cache[:seq].view(1, seq, 1, -1)
        xq = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
        xk = torch.view_as_complex(k.float().reshape(*k.shape[:-1], -1, 2))
        return torch.view_as_real(xq * cache).flatten(3), torch.view_as_real(xk * cache).flatten(3)


class Block(nn.Module):
    def __init__(self, region: bool) -> None:
        super().__init__()
        self.wq, self.wk, self.wo = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.rope, self.region = Rope(), region

    def body(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k = self.rope(self.wq(x).view(b, s, 2, 8), self.wk(x).view(b, s, 2, 8))
        att = torch.softmax(q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2), -1)
        return x + self.wo((att @ q.transpose(1, 2)).transpose(1, 2).reshape(b, s, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _region(self, x) if self.region else self.body(x)


@torch.compiler.nested_compile_region
def _region(block: Block, x: torch.Tensor) -> torch.Tensor:
    return block.body(x)


class Model(nn.Module):
    def __init__(self, region: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(region) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def materialize_conjugates(graph: torch.fx.Graph) -> None:
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten._conj.default):
        node.target = torch.ops.aten.conj_physical.default


def _backend(name: str, rewrite: bool):
    if name == "inductor":
        return "inductor"
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def partition(joint, inputs, **kwargs):
        if rewrite:
            materialize_conjugates(joint.graph)
        return min_cut_rematerialization_partition(joint, inputs, **kwargs)

    return aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=lambda gm, _: gm, partition_fn=partition)


class _Rewrite(CustomGraphPass):
    """`materialize_conjugates` in Inductor's joint-graph slot."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        materialize_conjugates(graph)

    def uuid(self) -> str:
        return "materialize_conjugates"


def run(backend: str, region: bool, rewrite: bool, inline_single_use: bool = True) -> str:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Model(region)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 12, 16)
    reference(x).backward()
    compiled = torch.compile(model, backend=_backend(backend, rewrite), fullgraph=True)
    try:
        with (
            inductor_config.patch(joint_custom_pre_pass=_Rewrite() if rewrite else None),
            torch._dynamo.config.patch(inline_single_use_invoke_subgraph=inline_single_use),
        ):
            compiled(x).backward()
    except Exception as error:  # the fact to print
        return f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"
    diff = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    return f"max |grad - eager grad| {diff:.2e}"


def main() -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="complex_region_probe_")
    print(f"torch {torch.__version__}: complex RoPE cache, 3 blocks, one forward and backward")
    for backend in ("aot_eager", "inductor"):
        for label, region, rewrite, inline in (
            ("no region", False, False, True),
            ("nested_compile_region", True, False, True),
            ("nested_compile_region, _conj -> conj_physical", True, True, True),
            ("... and inline_single_use_invoke_subgraph=False", True, True, False),
        ):
            print(f"  {backend:9s} {label:48s} {run(backend, region, rewrite, inline)}")


if __name__ == "__main__":
    main()
