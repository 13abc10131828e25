"""gloo groups with one worker thread for the graph's collectives (issue 10: the heap corruption).

torch's `ProcessGroupGloo` runs collectives on a pool of worker threads (2 by default). After a worker marks a
collective complete, it writes the collective's name into a `std::string` the group shares
(`pgStatus_->lastCompletedWorkName`) without holding a lock. When a second worker finishes the next collective of
the same group before the first one's write ends, both write the string at once, and names longer than the small
string buffer ("ALLGATHER_COALESCED", the functional all-gather) corrupt the heap. Keeping at most one collective
in flight per group (`passes.schedule`'s serial groups) narrows that window but cannot close it: the wait returns
before the write, and the next collective may start and finish on the other worker while the first one is
preempted. Seen: 1 crash in 16 runs of 1,000 steps on the 2-core machine with the serial schedule alone. A group
with a single worker thread runs its collectives and their bookkeeping one at a time, so the race cannot happen.

`torch.distributed.new_group` ignores `pg_options` for gloo, so the single-thread group is a registered backend
(`Backend.register_backend`, torch's public extension point) that builds a `ProcessGroupGloo` with `_threads=1`.
The copy keeps the timeout of the group it replaces: `new_group`'s own default is 30 minutes, so without it a hung
peer would stall this rank for half an hour whatever `init_process_group(timeout=...)` said.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

SINGLE_THREAD_GLOO = "fsdp_gloo"
GLOO_BACKENDS = frozenset({"gloo", SINGLE_THREAD_GLOO})

# (world group, purpose, ranks) -> the group (NON_GROUP_MEMBER where this rank is not in it). The world group is
# part of the key, so a re-initialised default group never reuses a destroyed one's groups.
_groups: dict[tuple[object, str, tuple[int, ...], timedelta | None], object] = {}


def _options(threads: int, timeout: timedelta) -> dist.ProcessGroupGloo._Options:
    options = dist.ProcessGroupGloo._Options()
    options._threads = threads
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_default_device()]
    return options


def _create_single_thread_gloo(store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroupGloo:
    return dist.ProcessGroupGloo(store, rank, size, _options(1, timeout))


def use_gloo_threads(threads: int) -> None:
    """From now on, every gloo group this process makes (`init_process_group("gloo")`'s world group, `new_group`'s,
    a DeviceMesh's) runs its collectives on `threads` worker threads instead of torch's 2, and keeps its backend
    name "gloo".

    For processes whose own gloo collectives may overlap: torch's FSDP2 and DDP keep several in flight on the
    user's group, and on two worker threads that corrupts the heap as described above (the test suite runs them as
    references). torch makes these groups as `ProcessGroupGloo(store, rank, size, timeout=...)` and ignores
    `pg_options` for gloo, so the class it calls is the one place the count can be chosen while the name stays
    "gloo", which torch and users' code compare against."""
    if threads < 1:
        raise ValueError(f"use_gloo_threads({threads}): a gloo group needs at least one worker thread")
    c10d = dist.distributed_c10d
    torch_class = getattr(c10d.ProcessGroupGloo, "_torch_class", c10d.ProcessGroupGloo)

    class ProcessGroupGloo(torch_class):
        _torch_class = torch_class

        def __init__(self, store, rank: int, size: int, timeout: timedelta = default_pg_timeout) -> None:
            super().__init__(store, rank, size, _options(threads, timeout))

    c10d.ProcessGroupGloo = ProcessGroupGloo


def _register() -> None:
    if SINGLE_THREAD_GLOO.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(SINGLE_THREAD_GLOO, _create_single_thread_gloo, devices=["cpu"])


def gloo_timeout(group: dist.ProcessGroup) -> timedelta | None:
    """The collective timeout of `group`'s CPU (gloo) backend; None where it has none."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (RuntimeError, AttributeError):
        return None


def is_gloo(group: dist.ProcessGroup) -> bool:
    return dist.get_backend(group) in GLOO_BACKENDS


def single_thread_gloo_group(
    rank_lists: Sequence[Sequence[int]], purpose: str, timeout: timedelta | None = None, *, members_only: bool = False
) -> dist.ProcessGroup:
    """This rank's group among `rank_lists` (every group of one mesh dimension), as a single-thread gloo group.

    Collective like `dist.new_group`: every rank of the world calls it with the same `rank_lists` and `purpose`, in
    the same order. Each (ranks, purpose) is created once per default group and then reused, so sharding many
    models does not open new connections each time. `purpose` keeps groups that must stay distinct apart (the
    gradient-reduction duplicate of a shard group). `timeout` (default: the world group's) bounds each collective.
    `members_only`: only this rank's group is made, and only its members call this (`use_local_synchronization`:
    torch's world-wide group counter does not move, so ranks that make different groups stay in step)."""
    _register()
    world = dist.group.WORLD
    if timeout is None:
        timeout = gloo_timeout(world)
    if members_only:
        rank_lists = [ranks for ranks in rank_lists if dist.get_rank() in ranks]
    mine = None
    for ranks in rank_lists:
        key = (world, purpose, tuple(int(r) for r in ranks), timeout)
        if key not in _groups:
            _groups[key] = dist.new_group(
                list(key[2]), backend=SINGLE_THREAD_GLOO, timeout=timeout, use_local_synchronization=members_only
            )
        if dist.get_rank() in key[2]:
            mine = _groups[key]
    if mine is None:
        raise ValueError(f"rank {dist.get_rank()} is in none of the groups {[list(r) for r in rank_lists]}")
    return mine
