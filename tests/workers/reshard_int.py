"""Rank-side workers for `reshard_after_forward=k` (an int): parity and which group each collective ran on."""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

import fsdp_graph
from fsdp_graph.planning.measure import collectives_per_group, executed_collectives, wire_bytes_per_group
from fsdp_graph.runtime.unit import flat_params
from tests.workers.training import Case, build, run_case


def per_phase(rank: int, mode: str, reshard: bool | int = 2) -> dict:
    """One warm-up step of the test GPT, then the forward and the backward of a second one: collectives counted
    per group ("piece", "node", "shard": the gathers' and the reductions' group) and kind, and in eager mode the
    bytes this rank sends per group. `reshard=True` has no piece or node group (their counts are 0)."""
    torch.manual_seed(0)
    model, loss_fn, make_batch = build("gpt")
    fsdp_graph.fully_shard(model, reshard_after_forward=reshard)
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
    names = [name for name in groups.values() if name]
    out = {
        "flat_params": len(states),
        "padded_numel": sum(s.layout.padded_numel for s in states),
        "uniform": isinstance(reshard, bool)
        or all(
            (s.piece_group, s.post_forward_group, s.post_forward_world) == (groups["piece"], groups["node"], reshard)
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
        out[phase] = {role: counts.get(name, 0) for role, name in groups.items()}
        out[phase + "_kinds"] = dict(kinds[phase].counts)
    if mode == "eager":  # a third step: the profiler would count the dispatch mode's re-dispatched collectives twice
        loss = []
        sent = {"fw": wire_bytes_per_group(lambda: loss.append(loss_fn(step, batch)))}
        sent["bw"] = wire_bytes_per_group(lambda: loss[0].backward())
        for phase, by_group in sent.items():
            out[phase + "_bytes"] = {role: dict(by_group.get(name, Counter())) for role, name in groups.items()}
    return out


def world_group_counter_moves() -> list[int]:
    """How far torch's world-wide group counter (it names the next world-wide group) moves in `fully_shard` with
    reshard_after_forward True, 2, 2: the first makes the shard group; k must move it no further (issue 27 item 7)."""
    counter = dist.distributed_c10d._world
    moves = []
    for reshard in (True, 2, 2):
        before = counter.group_count
        fsdp_graph.fully_shard(torch.nn.Linear(4, 4), reshard_after_forward=reshard)
        moves.append(counter.group_count - before)
    return moves


def reshard_int(rank: int, world: int, cases: list[Case]) -> dict:
    """Parity of `cases` with single-process training, and per-group collective counts, eager and compiled (eager:
    bytes per group too, with `reshard_after_forward=True` beside for comparison)."""
    return {
        "counter_moves": world_group_counter_moves(),
        "cases": [run_case(case, rank, world) for case in cases],
        "groups": {mode: per_phase(rank, mode) for mode in ("aot", "eager")},
        "whole": per_phase(rank, "eager", True),
    }
