"""Which step each rank has reached, kept in the default group's store, so that a collective that fails or times
out can name the ranks that never got there (a hung or stopped rank) instead of the rank whose wait timed out.

One store `set` per rank per step (the step it is about to run); read only after a failure.
"""

from __future__ import annotations

import torch.distributed as dist

_KEY = "fsdp_graph/progress/{}"


class RanksBehindError(RuntimeError):
    """A collective failed while some ranks had not started the step the others were in. `blamed_ranks`: those
    ranks (the launcher reports them as the root cause)."""

    def __init__(self, message: str, blamed_ranks: list[int]):
        self.blamed_ranks = blamed_ranks
        super().__init__(message)


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def record(step: int) -> None:
    """This rank is about to run `step` (1-based: the step's number in the job's output)."""
    _store().set(_KEY.format(dist.get_rank()), str(step))


def steps_started() -> dict[int, int]:
    """{rank: the last step it started}, for every rank that recorded one."""
    store, found = _store(), {}
    for rank in range(dist.get_world_size()):
        key = _KEY.format(rank)
        if store.check([key]):
            found[rank] = int(store.get(key))
    return found


def _collective_failure(error: BaseException) -> bool:
    """A collective that timed out or lost its peer (gloo raises RuntimeError or DistBackendError), as opposed to
    an error of this rank's own, which is the whole story."""
    text = str(error).lower()
    return isinstance(error, dist.DistError) or "timed out" in text or "connection closed" in text


def behind(error: BaseException) -> RanksBehindError | None:
    """After a collective failure broke this rank's step: a `RanksBehindError` naming the ranks that had not
    started the step this rank was in, or None (another kind of error, every rank in the same step, this rank
    itself behind, or the store gone too)."""
    if not _collective_failure(error):
        return None
    try:
        started = steps_started()
    except Exception:  # the store's host ended as well: the error is all there is
        return None
    if not started:
        return None
    front = max(started.values())
    world = dist.get_world_size()
    late = [r for r in range(world) if started.get(r, 0) < front]
    if not late or dist.get_rank() in late:
        return None
    ahead = [r for r in range(world) if started.get(r, 0) == front]
    lines = [f"rank {r} last started step {started[r]}" if r in started else f"rank {r} started no step" for r in late]
    last = str(error).strip().splitlines()
    cause = f"{type(error).__name__}: {last[-1] if last else ''}"
    return RanksBehindError(
        f"step {front}'s collectives failed on rank {dist.get_rank()} ({cause}). {_ranks(ahead)} started step "
        f"{front}; {'; '.join(lines)}: {'it' if len(late) == 1 else 'they'} never reached it (hung, stopped or dead).",
        late,
    )


def _ranks(ranks: list[int]) -> str:
    return ("Rank " if len(ranks) == 1 else "Ranks ") + ", ".join(str(r) for r in ranks)
