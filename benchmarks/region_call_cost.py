"""torch's own compile cost per call of a cached block body (issue 36's minimal repro), without fsdp_graph.

    python benchmarks/region_call_cost.py                    # 8 and 80 calls of a 64-wide block
    python benchmarks/region_call_cost.py --calls 8 80 --width 8192

A stack of `calls` identical residual MLP blocks, each block's weights passed to one function made a
`torch.compiler.nested_compile_region(reuse_hash_fn=...)` whose key is constant (every call is the same body), as
fsdp_graph's `reuse_blocks` makes each unit's block. `torch.compile(fullgraph=True, backend="aot_eager")` (Dynamo and
AOT autograd, eager kernels: no Inductor), one forward + backward. With `--mode inline` the same function is a plain
call, so Dynamo inlines every block. Each count runs in a fresh process and prints the first (compiling) and second
step's wall time and torch's own phase timers (`torch._dynamo.utils.compilation_time_metrics`), then the cost each added call brings.

What it isolates: Dynamo traces the body once and stamps it out for every later call; what each call still costs
is torch's (stamping out, the call's proxies and guards, AOT autograd and the min-cut partitioner over one more
`invoke_subgraph` in the joint graph). The block's width changes the tensors, not the graph, so that cost is the
same at any model size; compare it with `benchmarks/compile_depth_meta.py`'s cost per layer of fsdp_graph.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

_PHASES = (
    "bytecode_tracing",
    "invoke_subgraph_reuse_stamp_out",
    "build_guards",
    "create_aot_dispatcher_function",
    "_compile.compile_inner",
)


def measure(calls: int, width: int, mode: str) -> dict:
    import torch
    from torch import nn
    from torch._dynamo.utils import compilation_time_metrics

    def block(x, w_in, w_out):
        return x + torch.relu(x @ w_in) @ w_out

    body = block
    if mode == "region":
        body = torch.compiler.nested_compile_region(block, reuse_hash_fn=lambda *args: 0)

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w_in = nn.ParameterList(nn.Parameter(torch.randn(width, width) / width**0.5) for _ in range(calls))
            self.w_out = nn.ParameterList(nn.Parameter(torch.randn(width, width) / width**0.5) for _ in range(calls))

        def forward(self, x):
            for w_in, w_out in zip(self.w_in, self.w_out):
                x = body(x, w_in, w_out)
            return x

    torch.manual_seed(0)
    model = Stack()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, width)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        compiled(x).sum().backward()
        times.append(time.perf_counter() - start)
    phases = {name: sum(compilation_time_metrics.get(name, [])) for name in _PHASES}
    return {"calls": calls, "first_step_s": times[0], "second_step_s": times[1], **phases}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, nargs=2, default=[8, 80], metavar=("FEW", "MANY"))
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--mode", choices=("region", "inline"), default="region")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(measure(args.child, args.width, args.mode)))
        return 0
    runs = []
    for calls in args.calls:
        command = [sys.executable, __file__, "--child", str(calls), "--width", str(args.width), "--mode", args.mode]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    few, many = runs
    added = many["calls"] - few["calls"]
    print(f"{args.mode}, width {args.width}: {few['calls']} -> {many['calls']} calls")
    print(f"{'phase':34} {few['calls']:>8} {many['calls']:>8}  ms per added call")
    for name in ("first_step_s", "second_step_s", *_PHASES):
        print(f"{name:34} {few[name]:8.2f} {many[name]:8.2f}  {1e3 * (many[name] - few[name]) / added:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
