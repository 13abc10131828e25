"""Issue 35's goals on torchtitan's expert-parallel recipe: step time against torchtitan + FSDP2 + EP, and bytes.

    python benchmarks/titan_ep.py [--steps 6] [--layers 2] [--experts 64] [--top-k 8]

One run on 4 gloo ranks of this machine (ep 2 x efsdp 2): torchtitan 0.3.0's Qwen3 `debugmodel_moe` (`--layers`
of its layers, experts of hidden size 32, `--experts` of them) through its own `parallelize_qwen3`
(`tests/workers/titan.py`: what is not torchtitan's there is listed in docs/parallelism.md). Three setups on every
rank, stepped in turn (A B C A B C ...) after a barrier each, so a drift of the machine's speed hits all alike:
- torchtitan with torch's FSDP2 + EP (eager);
- the same recipe with `fsdp_graph.fsdp2.fully_shard` (eager);
- the same compiled with `fsdp_backend` (fullgraph; `--inductor` for Inductor, else eager kernels).
Printed: each setup's median step time and its ratio to FSDP2 + EP (goal: compiled <= 0.9x), `explain()`'s bytes
each rank sends per step by collective kind and by mesh dimension (the token all-to-alls' unbacked sizes are
counted at one row each: a planning guess), and each MoE block's largest gather against its dense part plus its
local experts' share (goal: <= 1.05x; the two are separate flat parameters, so the largest is the larger of them).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fsdp_graph  # noqa: E402
import fsdp_graph.fsdp2  # noqa: E402
from fsdp_graph.train.launch import spawn  # noqa: E402


def _run(rank: int, world: int, args: dict) -> dict:
    warnings.filterwarnings("ignore")
    from passes.cost import collective_cost, iter_collectives
    from passes.fx_nodes import bind_args
    from tests.workers import titan
    from tests.workers.fsdp2_titan import _batches, _train
    from tests.workers.titan_ep import _shard

    dims = titan.ep_dims(world, 2)
    sizes = dict(layers=args["layers"], expert_hidden=32, experts=args["experts"], top_k=args["top_k"])
    setups = {}
    for name, fully_shard in (
        ("FSDP2 + EP (eager)", torch.distributed.fsdp.fully_shard),
        ("fsdp_graph (eager)", fsdp_graph.fsdp2.fully_shard),
        ("fsdp_graph compiled", fsdp_graph.fsdp2.fully_shard),
    ):
        model = titan.build_ep("debugmodel_moe", dims, **sizes)
        _shard(model, dims, fully_shard)
        run = model
        if name.endswith("compiled"):
            run = torch.compile(model, backend=fsdp_graph.make_backend(inductor=args["inductor"]), fullgraph=True)
        _train(run, model, rank, world, 2)  # warm-up: compile, first-use sharding
        setups[name] = (run, model, [])
    for _ in range(args["steps"]):
        for run, model, times in setups.values():
            torch.distributed.barrier()
            start = time.perf_counter()
            _train(run, model, rank, world, 1)
            times.append(time.perf_counter() - start)
    out = {"steps": {name: statistics.median(times) for name, (_, _, times) in setups.items()}}

    from torchtitan.components.loss import cross_entropy_loss

    model = titan.build_ep("debugmodel_moe", dims, **sizes)
    _shard(model, dims, fsdp_graph.fsdp2.fully_shard)
    tokens, labels, count = next(_batches(rank, world, 1, model.tok_embeddings.num_embeddings))
    report = fsdp_graph.explain(model, tokens, None, None, loss_fn=lambda o: cross_entropy_loss(o, labels) / count)
    by_kind: Counter = Counter()
    for graph in report.graphs:
        for node, kind, unit in iter_collectives(graph.graph):
            n, payload, _ = collective_cost(node, report.hardware, report.world, report.group_sizes)
            if n > 1:
                role = report.group_roles.get(bind_args(node).get("group_name"), "?")
                label = f"{kind} on {role}" + ("" if unit is not None else " (the model's own)")
                by_kind[label] += payload * (n - 1) / n * (2 if kind == "all_reduce" else 1)
    out["by_kind"] = dict(by_kind)
    out["by_group"] = report.sent_bytes_by_group
    rows = {row.unit: row.unsharded_bytes for row in report.units}
    out["blocks"] = {
        unit: (rows[unit], rows[f"{unit}[efsdp]"]) for unit in rows if unit.startswith("layers.") and "[" not in unit
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--inductor", action="store_true")
    a = parser.parse_args()
    args = dict(steps=a.steps, layers=a.layers, experts=a.experts, top_k=a.top_k, inductor=a.inductor)
    results = spawn(_run, 4, (args,), timeout_s=1200)
    r = results[0]
    base = max(res["steps"]["FSDP2 + EP (eager)"] for res in results)
    print(f"torchtitan Qwen3 debugmodel_moe, {a.layers} layers, {a.experts} experts (top {a.top_k}), 4 gloo ranks")
    print("median step time (slowest rank):")
    for name in r["steps"]:
        step = max(res["steps"][name] for res in results)
        print(f"  {name:24s} {step * 1e3:9.1f} ms  {step / base:5.2f}x FSDP2 + EP")
    print("sent per rank per step (explain):")
    for label, sent in sorted(r["by_kind"].items()):
        print(f"  {label:40s} {sent / 2**20:8.3f} MiB")
    for group, sent in sorted(r["by_group"].items()):
        print(f"  on {group:37s} {sent / 2**20:8.3f} MiB")
    print("largest gather of each MoE block vs its dense part + its local experts' share:")
    for unit, (dense, experts) in r["blocks"].items():
        print(f"  {unit}: {max(dense, experts) / 2**20:.3f} MiB, dense {dense / 2**20:.3f} + experts "
              f"{experts / 2**20:.3f} MiB: {max(dense, experts) / (dense + experts):.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
