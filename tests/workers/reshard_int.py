"""Rank-side workers for `reshard_after_forward=k` (an int): parity and which group each collective ran on."""

from __future__ import annotations

import torch

import fsdp_graph
from fsdp_graph.planning.measure import collectives_per_group, executed_collectives
from fsdp_graph.runtime.unit import flat_params
from tests.workers.training import Case, build, run_case


def _per_phase(rank: int, mode: str) -> dict:
    """One warm-up step, then the forward and the backward of a second one, each counted per group and kind."""
    torch.manual_seed(0)
    model, loss_fn, make_batch = build("gpt")
    fsdp_graph.fully_shard(model, reshard_after_forward=2)
    states = flat_params(model)
    groups = {
        "piece": states[0].piece_group,
        "node": states[0].post_forward_group,
        "shard": states[0].reduce_group or states[0].group_name,
    }
    step = model
    if mode == "aot":
        step = torch.compile(model, backend=fsdp_graph.make_backend(inductor=False), fullgraph=True)
    batch = make_batch(torch.Generator().manual_seed(rank), 4)
    loss_fn(step, batch).backward()
    names = list(groups.values())
    out = {
        "flat_params": len(states),
        "uniform": all(
            (s.piece_group, s.post_forward_group, s.post_forward_world) == (groups["piece"], groups["node"], 2)
            for s in states
        ),
    }
    loss = []
    kinds = {}
    fw = collectives_per_group(
        lambda: kinds.__setitem__("fw", executed_collectives(lambda: loss.append(loss_fn(step, batch)))), names
    )
    bw = collectives_per_group(lambda: kinds.__setitem__("bw", executed_collectives(lambda: loss[0].backward())), names)
    for phase, counts in (("fw", fw), ("bw", bw)):
        out[phase] = {role: counts[name] for role, name in groups.items()}
        out[phase + "_kinds"] = dict(kinds[phase].counts)
    return out


def reshard_int(rank: int, world: int, cases: list[Case]) -> dict:
    """Parity of `cases` with single-process training, and per-group collective counts, eager and compiled."""
    return {
        "cases": [run_case(case, rank, world) for case in cases],
        "groups": {mode: _per_phase(rank, mode) for mode in ("aot", "eager")},
    }
