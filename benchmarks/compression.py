"""Quantized collectives (`make_backend(compress=...)`, ZeRO++'s qwZ + qgZ) on a communication-heavy step.

    python benchmarks/compression.py [--steps 10] [--compress int8]
    python benchmarks/compression.py --codec     # only the quantizers' cost per element under Inductor

One run on 2 gloo ranks of this machine: a Llama of dim 256, 4 blocks, vocabulary 1024, 4 x 128 tokens per rank,
SGD with momentum. Four setups on every rank, stepped in turn (A B C D ...) after a barrier each, so a drift of the
machine's speed hits all alike:
- fsdp_graph FULL_SHARD, Inductor, uncompressed (fp32 on the wire);
- the same with `compress` (default "int8": int8 weights and gradients, 256-element blocks, float32 scales);
- torch DDP (eager) and torch FSDP2 (eager, `fully_shard` per block then the root).
Printed: bytes each rank sends per step (from the lowered graphs' collectives: (n - 1) / n of each payload, scales
included) compressed vs uncompressed, and each setup's median step time with its ratio to DDP and FSDP2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._functorch.config
import torch._inductor.config
import torch.distributed as dist

import fsdp_graph
from fsdp_graph.train.launch import spawn
from fsdp_graph.train.llama import Llama, LlamaConfig, llama_loss

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIG = LlamaConfig(vocab=1024, dim=256, layers=4, heads=8, kv_heads=4, hidden=704, seq=128, tied=True)
BATCH = 4


def _sent_bytes(backend: fsdp_graph.FSDPBackend, world: int) -> float:
    """Bytes this rank sends per step: (n - 1) / n of every collective's payload in the forward and backward."""
    return sum(sum(r.collectives.bytes.values()) for r in backend.reports) * (world - 1) / world


def _setups(rank: int, world: int, compress: str) -> dict:
    def model() -> Llama:
        torch.manual_seed(0)
        return Llama(CONFIG)

    setups, backends = {}, {}
    for name, option in (("fsdp_graph", None), (f"fsdp_graph {compress}", compress)):
        m = fsdp_graph.fully_shard(model())
        backends[name] = fsdp_graph.make_backend(compress=option)
        setups[name] = (torch.compile(m, backend=backends[name], fullgraph=True), m.parameters())
    ddp = torch.nn.parallel.DistributedDataParallel(model())
    setups["DDP"] = (ddp, ddp.parameters())
    from torch.distributed.fsdp import fully_shard

    fsdp2 = model()
    for block in fsdp2.blocks:
        fully_shard(block)
    fully_shard(fsdp2)
    setups["FSDP2"] = (fsdp2, fsdp2.parameters())
    return setups, backends


def run(rank: int, world: int, steps: int, compress: str) -> dict:
    # The bytes come from the lowering pass's reports, which a warm FX graph cache would skip (0 bytes).
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    setups, backends = _setups(rank, world, compress)
    gen = torch.Generator().manual_seed(1 + rank)
    optimizers = {n: torch.optim.SGD(p, lr=1e-2, momentum=0.9) for n, (_, p) in setups.items()}
    times: dict[str, list[float]] = {n: [] for n in setups}
    for step in range(steps + 2):  # two warm-up steps (compiles) are not timed
        ids = torch.randint(0, CONFIG.vocab, (BATCH, CONFIG.seq + 1), generator=gen)
        for name, (model, _) in setups.items():
            dist.barrier()
            start = time.perf_counter()
            llama_loss(model, (ids[:, :-1], ids[:, 1:])).backward()
            optimizers[name].step()
            optimizers[name].zero_grad()
            if step >= 2:
                times[name].append(time.perf_counter() - start)
    return {
        "median": {n: statistics.median(t) for n, t in times.items()},
        "sent": {n: _sent_bytes(b, world) for n, b in backends.items()},
    }


def codec_costs(numel: int = 1 << 20, block_size: int = 256, reps: int = 20) -> None:
    """Each scheme's pack and unpack as Inductor compiles them (one thread, this process): ns per element, the
    median of `reps` calls, next to an fp32 copy. What a step pays per element gathered or reduced."""
    from passes.quantize import SCHEMES, pack_rows, unpack_rows

    torch.set_num_threads(1)

    def median_s(fn, arg) -> float:
        fn(arg)
        fn(arg)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn(arg)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    x = torch.randn(2, numel // 2)
    copy = median_s(torch.compile(lambda t: t * 1.0), x)
    for scheme in SCHEMES:
        pack = torch.compile(lambda t, s=scheme: pack_rows(t, 2, numel // 2, s, block_size), fullgraph=True)
        packed = pack(x)
        unpack = torch.compile(
            lambda p, s=scheme: unpack_rows(p, 2, numel // 2, torch.float32, s, block_size), fullgraph=True
        )
        ns = [1e9 * median_s(f, a) / numel for f, a in ((pack, x), (unpack, packed))]
        print(f"{scheme}: pack {ns[0]:.2f} ns/element, unpack {ns[1]:.2f} (fp32 copy {1e9 * copy / numel:.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compress", default="int8", help="fsdp_graph.Compression.parse text (default: int8)")
    parser.add_argument("--codec", action="store_true", help="only time the quantizers (codec_costs) and exit")
    args = parser.parse_args()
    if args.codec:
        codec_costs()
        return
    results = spawn(run, 2, (args.steps, args.compress))
    names = list(results[0]["median"])
    median = {n: statistics.mean(r["median"][n] for r in results) for n in names}
    sent = results[0]["sent"]
    plain, packed = sent["fsdp_graph"], sent[f"fsdp_graph {args.compress}"]
    print(f"Llama dim {CONFIG.dim}, {CONFIG.layers} blocks, vocab {CONFIG.vocab}, {BATCH} x {CONFIG.seq} tokens/rank")
    print(
        f"bytes sent per rank per step: uncompressed {plain / 2**20:.3f} MiB, {args.compress} {packed / 2**20:.3f} "
        f"MiB: {packed / plain:.3f}x"
    )
    for name in names:
        print(
            f"{name:24s} {1e3 * median[name]:8.1f} ms/step  x{median[name] / median['DDP']:.2f} DDP  "
            f"x{median[name] / median['FSDP2']:.2f} FSDP2"
        )


if __name__ == "__main__":
    main()
