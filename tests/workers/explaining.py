"""explain()'s predicted peak memory against the measured one (run inside each gloo rank; also benchmarks/explain.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fsdp_graph
from fsdp_graph.planning.measure import peak_allocated_bytes
from fsdp_graph.train.llama import Llama, preset
from tests.workers.training import build


def _build(name: str):
    """(model, make_batch(generator, batch_size)): tests.workers.training's models, plus "llama" (the main job's tiny preset)."""
    if name == "llama":
        cfg = preset("tiny")
        return Llama(cfg), lambda g, b: tuple(torch.randint(0, cfg.vocab, (b, cfg.seq), generator=g) for _ in range(2))
    model, _, make_batch = build(name)
    return model, make_batch


def inputs_and_loss(name: str, batch: tuple) -> tuple[tuple, object]:
    """The model's inputs and its loss as a function of its output (explain's `loss_fn`; None: the model
    returns its loss)."""
    inputs, target = batch[0], batch[1]
    if name in ("gpt", "llama"):
        return (inputs,), lambda logits: F.cross_entropy(logits.flatten(0, 1), target.flatten())
    if name == "hf":
        return (inputs, target), None
    return (inputs,), lambda out: F.mse_loss(out, target)


def _train_step(model, loss_fn, inputs):
    out = model(*inputs)
    return loss_fn(out) if loss_fn is not None else out["loss"]


def predicted_vs_measured(
    rank: int, world: int, name: str, batch_size: int, reuse_blocks: bool | None = None, repeats: int = 5
) -> dict[str, float]:
    """Peak bytes one forward + backward allocates above the step's starting point: predicted by `explain`
    (eager-kernel executor) and measured (profiler memory events, the least of `repeats` steps after a warm-up step
    that compiles), both for the model and its loss compiled as one graph with `make_backend(inductor=False)`, the
    model sharded with `fully_shard(model, reuse_blocks=reuse_blocks)` (None: its default, shared block bodies).

    The least, not the median: a finished gloo collective's tensors are released by gloo's worker thread, a moment
    after `wait_tensor` returns. When the graph allocates in that moment, the step peaks higher by up to one
    unit's gradient (seen: +5.8% and +11.6% in 3 of 24 steps of the GPT). That is gloo's timing, not the graph's
    memory, which the least of a few steps measures; `spread` reports how much the steps differ."""
    torch.manual_seed(0)
    model, make_batch = _build(name)
    fsdp_graph.fully_shard(model, reuse_blocks=reuse_blocks)
    batch = make_batch(torch.Generator().manual_seed(100 + rank), batch_size)
    inputs, loss_fn = inputs_and_loss(name, batch)
    report = fsdp_graph.explain(model, *inputs, loss_fn=loss_fn, inductor=False)

    compiled = torch.compile(_train_step, backend=fsdp_graph.make_backend(inductor=False), fullgraph=True)

    def step():
        compiled(model, loss_fn, inputs).backward()

    def clear_grads():
        for p in model.parameters():
            p.grad = None

    step()  # compiles: its allocations are not the step's
    clear_grads()
    peaks = []
    for _ in range(repeats):
        peak, _ = peak_allocated_bytes(step)
        clear_grads()
        peaks.append(peak)
    measured = min(peaks)
    predicted = report.memory.peak_bytes
    return {
        "predicted": float(predicted),
        "measured": float(measured),
        "error": predicted / measured - 1,
        "persistent": float(report.memory.persistent_bytes),
        "spread": (max(peaks) - min(peaks)) / measured,
    }


def predicted_vs_measured_per_reuse(
    rank: int, world: int, name: str, batch_size: int, reuse_settings: tuple[bool | None, ...]
) -> list[dict[str, float]]:
    """`predicted_vs_measured` for each `fully_shard(reuse_blocks=...)` setting, in one spawn of the ranks."""
    return [predicted_vs_measured(rank, world, name, batch_size, reuse) for reuse in reuse_settings]
