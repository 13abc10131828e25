"""What torch.compile makes of `nested_compile_region` blocks (issue 15), printed as facts: one process, CPU, eager
kernels after AOT autograd (no Inductor), a fake process group of 4 for the sharded model.

    python benchmarks/block_reuse_probe.py                 # 4 layers
    python benchmarks/block_reuse_probe.py --layers 4 16   # Dynamo + AOT + passes seconds, by depth

For each of: the plain Llama, the plain Llama with each block's forward a `nested_compile_region`, `fully_shard`, and
`fully_shard(reuse_blocks=True)`, it prints the bodies the Dynamo graph calls (`subgraph_0 x4`: one body traced
once and stamped out), the bodies the AOT forward and backward graphs call (kept, not inlined), the gathers in the
outer forward and backward graphs, and the first step's seconds (Dynamo, AOT autograd, our passes, eager kernels).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp_graph
from fsdp_graph.train.llama import Llama, LlamaConfig, llama_loss

VARIANTS = ("plain", "plain + region", "fully_shard", "fully_shard reuse_blocks")


def _bodies(gm: fx.GraphModule) -> str:
    calls = gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)
    counts = Counter(str(node.args[1]) for node in calls)
    return ", ".join(f"{name} x{n}" for name, n in sorted(counts.items())) or "none"


def _gathers(gm: fx.GraphModule) -> int:
    names = ("fsdp.unshard", "all_gather_into_tensor")
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and any(k in str(n.target) for k in names))


def probe(variant: str, layers: int) -> dict[str, str]:
    """One first training step of `variant`; what each graph calls and how long the step took."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = LlamaConfig(dim=64, layers=layers, heads=4, kv_heads=2, hidden=176, seq=64, vocab=256)
    model = Llama(cfg)
    seen: dict[str, str] = {}
    if variant.startswith("fully_shard"):
        fsdp_graph.fully_shard(model, reuse_blocks=variant.endswith("reuse_blocks"))
        inner = fsdp_graph.make_backend(inductor=False, keep_graphs=True, verify_collectives=False)

        def backend(gm, example_inputs):
            seen["dynamo"] = _bodies(gm)
            return inner(gm, example_inputs)
    else:
        inner = None
        if variant.endswith("region"):
            block_class = type(model.blocks[0])
            forward = torch.compiler.nested_compile_region(block_class.forward)
            region_class = type("RegionBlock", (block_class,), {"forward": forward})
            for block in model.blocks:
                block.__class__ = region_class

        def keep(stage: str):
            def compile_graph(gm, example_inputs):
                seen[stage] = _bodies(gm)
                return make_boxed_func(gm.forward)

            return compile_graph

        def backend(gm, example_inputs):
            seen["dynamo"] = _bodies(gm)
            return aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"))(gm, example_inputs)

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    tokens = torch.randint(0, cfg.vocab, (4, cfg.seq + 1), generator=torch.Generator().manual_seed(1))
    start = time.perf_counter()
    llama_loss(compiled, (tokens[:, :-1], tokens[:, 1:])).backward()
    seen["first step"] = f"{time.perf_counter() - start:.1f} s"
    for report in inner.reports if inner is not None else ():  # the backward compiles during the first backward
        seen[report.stage] = f"{_bodies(report.graph)}; gathers {_gathers(report.graph)}"
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", nargs="+", type=int, default=[4])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    args = parser.parse_args()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        for layers in args.layers:
            for variant in args.variants:
                facts = probe(variant, layers)
                print(f"{variant} ({layers} layers):", flush=True)
                for key, value in facts.items():
                    print(f"    {key}: {value}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
