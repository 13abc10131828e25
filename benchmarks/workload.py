"""The one workload every CPU benchmark trains: a small tied Llama (the main job's model family) on the corpus
shipped with the package, so benchmark inputs do not change when the project's source does.

4 layers, dim 256, 8 heads (4 key/value heads), SwiGLU hidden 704, sequence 128, byte vocabulary: 3.0 M
parameters, the size of the GPT the first benchmarks used.
"""

from __future__ import annotations

from collections.abc import Iterator

from fsdp_graph.train.corpus import batch_at, load_tokens
from fsdp_graph.train.llama import Llama, LlamaConfig, llama_loss

BENCH_CONFIG = LlamaConfig(dim=256, layers=4, heads=8, kv_heads=4, hidden=704, seq=128, tied=True)

__all__ = ["BENCH_CONFIG", "batches", "bench_model", "llama_loss"]  # llama_loss: the benchmarks' loss


def bench_model(cfg: LlamaConfig = BENCH_CONFIG) -> Llama:
    return Llama(cfg)


def batches(batch: int, rank: int, world: int, seed: int, seq: int = BENCH_CONFIG.seq) -> Iterator[tuple]:
    """This rank's (inputs, targets) of every step's global batch, step 0 first (`corpus.batch_at`)."""
    tokens = load_tokens()
    step = 0
    while True:
        yield batch_at(tokens, step, seed, batch, seq, rank, world)
        step += 1
