"""Start N local gloo ranks from one process (CPU machines, tests, the demo). Under torchrun use its env."""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

_HOST = "127.0.0.1"


def _entry(rank: int, fn: Callable, world: int, port: int, timeout_s: float, out_dir: str, args: tuple) -> None:
    # As torchrun does: ranks sharing a machine split its cores instead of oversubscribing them.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(_HOST, port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        result = fn(rank, world, *args)
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        dist.barrier()  # nobody tears the group down while a peer still has collectives in flight
    except BaseException:
        # Timestamped, so the parent can tell the root cause from the ranks that failed because of it.
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(f"{time.time()}\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()
    # Success: the result is on disk and the group is gone. Leave without running C++ static destructors:
    # torch.distributed.checkpoint can leave a background thread joinable at interpreter exit, which aborts
    # the process ("terminate called without an active exception") after all its work succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class RankFailedError(RuntimeError):
    """A rank raised. The message starts with the rank that failed first (the root cause) and its traceback;
    ranks that failed after it (typically a peer's collective breaking) follow."""

    def __init__(self, failures: list[tuple[float, int, str]]):
        self.rank = failures[0][1]
        first = f"rank {self.rank} failed first:\n{failures[0][2]}"
        later = "".join(f"\nthen rank {rank} failed:\n{text}" for _, rank, text in failures[1:])
        super().__init__(first + later)


def _failures(out_dir: str, world: int) -> list[tuple[float, int, str]]:
    failures = []
    for rank in range(world):
        path = os.path.join(out_dir, f"rank{rank}.err")
        if os.path.exists(path):
            with open(path) as f:
                stamp, _, text = f.read().partition("\n")
            failures.append((float(stamp), rank, text))
    return sorted(failures)


def spawn(fn: Callable[..., Any], world: int = 2, args: tuple = (), timeout_s: float = 300.0) -> list[Any]:
    """Run `fn(rank, world, *args)` on `world` gloo ranks on 127.0.0.1 and return each rank's result.

    A rank that raises ends every rank (torch.multiprocessing terminates the rest) and `RankFailedError` names the
    rank that failed first, with its traceback; collectives time out after `timeout_s` so nothing hangs forever.
    `fn` must be importable (a module-level function) and its result picklable.
    """
    # The parent owns the rendezvous store, bound to a port the OS picks and held for the whole run: no window in
    # which another process could take the port between choosing and binding it.
    store = dist.TCPStore(
        _HOST, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(
                _entry,
                args=(fn, world, store.port, timeout_s, out_dir, args),
                nprocs=world,
                join=True,
                start_method="spawn",
            )
        except ProcessException as e:
            failures = _failures(out_dir, world)
            if not failures:
                raise
            raise RankFailedError(failures) from e
        results = []
        for rank in range(world):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
