"""Start N local gloo ranks from one process (CPU machines, tests, the main job). Under torchrun use its env."""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import gc
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fsdp_graph.runtime.gloo import use_gloo_threads

_HOST = "127.0.0.1"
# After the first rank fails, how long its peers get to fail on their own (their errors then follow the root
# cause in the report) before the launcher ends them.
_GRACE_S = 2.0
_STARTUP = datetime.timedelta(minutes=10)  # how long ranks may take to start and meet


class _CallersFd:
    """One of the caller's file descriptors as it is now, duplicated into the rank when the rank starts."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return (_detach, (reduction.DupFd(self.fd),))


def _detach(dup) -> int:
    return dup.detach()


def _entry(
    rank: int,
    fn: Callable,
    world: int,
    port: int,
    timeout_s: float,
    out_dir: str,
    args: tuple,
    env: dict,
    outputs: tuple[int, int],
) -> None:
    # A forkserver child has the server's environment and standard streams, taken when the server started (under
    # pytest, the capture of whichever test ran first): use the caller's, as they are now.
    os.environ.clear()
    os.environ.update(env)
    # Ctrl-C reaches every process of the terminal's group: the launcher ends the ranks, which stay silent
    # (a KeyboardInterrupt traceback per rank says nothing the launcher does not).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for target, fd in zip((1, 2), outputs):
        if fd != target:  # under spawn the child inherits the caller's descriptors under the same numbers
            os.dup2(fd, target)
            os.close(fd)
    # A crash in native code (SIGSEGV, SIGABRT, ...) leaves no Python traceback: every thread's Python stack at that
    # moment goes to a file the launcher puts in the failure it reports. The file stays open until the process ends.
    faulthandler.enable(open(os.path.join(out_dir, f"rank{rank}.fault"), "w"), all_threads=True)
    # What the rank inherited or imported (torch's and the caller's modules: 300,000-400,000 objects the collector
    # tracks) lives as long as the process: frozen out of the cyclic collector's reach, each full collection scans only
    # what the rank made since. Before, the suite's ranks spent 99 s in 279 full collections (median 0.3 s,
    # 2026-12-07). Reference counting still frees those objects; only a cycle among them would stay.
    gc.freeze()
    # As torchrun does: ranks sharing a machine split its cores instead of oversubscribing them.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(_HOST, port, is_master=False, timeout=max(timeout, _STARTUP))
    # Start-up (imports on a busy machine) must not count against the collective timeout: meet every rank first.
    # A rank that dies before arriving ends the others through the parent, not through this wait.
    store.set(f"fsdp_graph_launch/ready/{rank}", "1")
    store.wait([f"fsdp_graph_launch/ready/{r}" for r in range(world)])
    threads = _gloo_threads()
    if threads is not None:
        use_gloo_threads(threads)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        result = fn(rank, world, *args)
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        dist.barrier()  # nobody tears the group down while a peer still has collectives in flight
    except BaseException as e:
        _write_error(os.path.join(out_dir, f"rank{rank}.err"), e)
        raise
    finally:
        dist.destroy_process_group()
    # Success: the result is on disk and the group is gone. Leave without running C++ static destructors:
    # torch.distributed.checkpoint can leave a background thread joinable at interpreter exit, which aborts
    # the process ("terminate called without an active exception") after all its work succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _write_error(path: str, error: BaseException) -> None:
    """Timestamped, so the parent can tell the root cause from the ranks that failed because of it. An error that
    says all there is in its message (`fsdp_graph_brief = True`: a failed save, a non-finite step) is written
    without its traceback; one that blames other ranks (`blamed_ranks`: a collective that timed out waiting for
    them) names them on a line of its own."""
    text = f"{error}\n" if getattr(error, "fsdp_graph_brief", False) else traceback.format_exc()
    blamed = " ".join(str(r) for r in getattr(error, "blamed_ranks", ()))
    with open(path, "w") as f:
        f.write(f"{time.time()}\nblame: {blamed}\n{text}")


def _read_error(path: str) -> tuple[float, list[int], str]:
    with open(path) as f:
        stamp, blame, text = f.read().split("\n", 2)
    return float(stamp), [int(r) for r in blame.removeprefix("blame:").split()], text


class RankFailedError(RuntimeError):
    """A rank raised, or died without raising (killed by a signal, e.g. SIGKILL from the OOM killer or
    `kill -9`). The message starts with the rank that failed first (the root cause) and its traceback or exit
    status; the ranks that failed after it (typically a peer's collective breaking) follow with their last line,
    then the ranks the launcher had to end. `rank` is the root cause's rank, `signal` the signal's name when one
    killed it, `failures` every failed rank's (time, rank, full text), root cause first."""

    def __init__(self, failures: list[tuple[float, int, str]], ended: tuple[int, ...] = (), signal: str | None = None):
        self.rank = failures[0][1]
        self.failures, self.ended, self.signal = failures, ended, signal
        first = f"rank {self.rank} failed first:\n{failures[0][2]}"
        later = "".join(
            f"\nthen rank {rank} failed" + (" the same way" if text == failures[0][2] else f": {_last_line(text)}")
            for _, rank, text in failures[1:]
        )
        tail = "".join(
            f"\nrank {rank} was still running {_GRACE_S:g} s after the first failure; the launcher ended it."
            for rank in ended
        )
        super().__init__(first + later + tail)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no message)"


def _exit_status(exitcode: int) -> tuple[str, str | None]:
    """A sentence for a rank that ended without a Python traceback, and the signal's name if one killed it."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return (
            f"the process was killed by {name} without raising an exception (killed from outside, e.g. by the "
            "OOM killer or `kill -9`, or crashed in native code).\n",
            name,
        )
    return f"the process exited with code {exitcode} without a Python traceback.\n", None


def _fault_stack(path: str) -> str:
    """The Python stacks faulthandler wrote when the rank crashed in native code; nothing when it wrote none."""
    try:
        with open(path) as f:
            # Its closing list of loaded extension modules says nothing about where the rank was.
            stack = "\n".join(line for line in f.read().splitlines() if not line.startswith("Extension modules:"))
            stack = stack.strip()
    except OSError:
        return ""
    return f"Its Python stacks at the crash (faulthandler):\n{stack}\n" if stack else ""


def _failures(
    out_dir: str, world: int, exits: dict[int, tuple[float, int]], states: dict[int, str]
) -> tuple[list[tuple[float, int, str]], str | None]:
    """(failures with the root cause first, the signal that killed the root cause). A rank that vanished without
    a traceback comes before ranks that raised: a peer's death makes the others raise (a broken collective), never
    vanish, and the parent notices a death later than the peers do. A rank that neither raised nor ended but that
    the first rank to blame others names (its collective timed out waiting for it: hung, or stopped) comes first.
    `states`: the process state of each rank still running when the launcher ended it."""
    raised, vanished, signals, blamed = [], [], {}, []
    for rank in range(world):
        path = os.path.join(out_dir, f"rank{rank}.err")
        if os.path.exists(path):
            stamp, blames, text = _read_error(path)
            raised.append((stamp, rank, text))
            blamed.append((stamp, rank, blames))
        elif rank in exits and exits[rank][1] != 0:
            text, signals[rank] = _exit_status(exits[rank][1])
            text += _fault_stack(os.path.join(out_dir, f"rank{rank}.fault"))
            vanished.append((exits[rank][0], rank, text))
    failures = sorted(vanished) + sorted(raised)
    accusers = sorted(entry for entry in blamed if entry[2])
    if not vanished and accusers:
        stamp, accuser, blames = accusers[0]
        hung = [
            (
                stamp,
                rank,
                f"it stopped making progress ({states[rank]}); rank {accuser}'s collective timed out "
                f"waiting for it:\n{_last_line(dict((r, t) for _, r, t in raised)[accuser])}\n",
            )
            for rank in blames
            if rank in states
        ]
        failures = hung + failures
    return failures, (signals.get(failures[0][1]) if failures else None)


def _process_state(pid: int | None) -> str:
    """'its process was stopped, e.g. by SIGSTOP' and the like, from /proc (Linux); a plain phrase elsewhere."""
    names = {
        "T": "stopped, e.g. by SIGSTOP",
        "t": "stopped by a debugger",
        "S": "sleeping",
        "D": "in disk I/O",
        "R": "running",
        "Z": "a zombie",
    }
    try:
        with open(f"/proc/{pid}/status") as f:
            state = next(line.split()[1] for line in f if line.startswith("State:"))
    except (OSError, StopIteration, IndexError):
        return "its process was still running"
    return f"its process was {names.get(state, 'in state ' + state)}"


def _end(processes: list, ranks: list[int]) -> None:
    """SIGKILL: a rank may handle SIGTERM as 'finish the step and save' (the main job does), which is not what
    ending it after a peer's failure or on Ctrl-C asks for."""
    for rank in ranks:
        if processes[rank].is_alive():
            processes[rank].kill()
    for rank in ranks:
        processes[rank].join()


def _watch(processes: list, out_dir: str) -> tuple[dict[int, tuple[float, int]], list[int]]:
    """Wait for every rank. From the first failure on, the rest get `_GRACE_S` to end on their own. Returns
    {rank: (when the parent saw it exit, exit code)} and the ranks still running when the grace ran out."""
    sentinels = {p.sentinel: rank for rank, p in enumerate(processes)}
    exits: dict[int, tuple[float, int]] = {}
    failed_at = None
    while sentinels:
        timeout = None if failed_at is None else max(0.0, failed_at + _GRACE_S - time.monotonic())
        ready = multiprocessing.connection.wait(list(sentinels), timeout)
        if not ready:
            break
        for sentinel in ready:
            rank = sentinels.pop(sentinel)
            processes[rank].join()
            exits[rank] = (time.time(), processes[rank].exitcode)
            # An interrupted rank exits 0 (torch's wrapper swallows KeyboardInterrupt) but leaves its error.
            failed = exits[rank][1] != 0 or os.path.exists(os.path.join(out_dir, f"rank{rank}.err"))
            if failed and failed_at is None:
                failed_at = time.monotonic()
    return exits, sorted(sentinels.values())


FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
LAUNCHER_PID_ENV = "FSDP_GRAPH_LAUNCHER_PID"  # set in the ranks' environment (the main job's test hooks signal it)


@contextlib.contextmanager
def _forwarding_signals(processes: list):
    """While the ranks run, SIGTERM and SIGUSR1 sent to this process go to every rank that is still alive."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum, frame) -> None:
        for p in processes:
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


START_METHOD_ENV = "FSDP_GRAPH_START_METHOD"
# The worker threads of each gloo group a rank makes (`fsdp_graph.runtime.gloo.use_gloo_threads`); unset: torch's 2.
GLOO_THREADS_ENV = "FSDP_GRAPH_GLOO_THREADS"
_PRELOAD = ["torch", "fsdp_graph", "fsdp_graph.train.warm_start"]


def _start_method(fn: Callable) -> str:
    """ "spawn" (a fresh interpreter per rank: each imports torch, seconds on a small machine), or with
    FSDP_GRAPH_START_METHOD=forkserver, ranks forked from one server process that imported torch, fsdp_graph and
    `fn`'s module once and warmed the compile stack up (`fsdp_graph.train.warm_start`; the test suite runs hundreds
    of short multi-rank runs). The server starts clean (no
    threads of the caller's, no process group) and each rank gets the caller's current environment (`_entry`)."""
    method = os.environ.get(START_METHOD_ENV, "spawn")
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"{START_METHOD_ENV}={method!r}: use 'spawn' or 'forkserver'")
    if method == "forkserver":
        # Read when the server starts (the first forkserver launch); later calls' modules are imported per rank.
        multiprocessing.set_forkserver_preload([*_PRELOAD, fn.__module__])
    return method


def _gloo_threads() -> int | None:
    value = os.environ.get(GLOO_THREADS_ENV)
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{GLOO_THREADS_ENV}={value!r}: give the number of worker threads per gloo group (1 or more)")
    return int(value)


def spawn(fn: Callable[..., Any], world: int = 2, args: tuple = (), timeout_s: float = 300.0) -> list[Any]:
    """Run `fn(rank, world, *args)` on `world` gloo ranks on 127.0.0.1 and return each rank's result.

    A rank that raises or dies (a signal, e.g. SIGKILL) ends every rank: its peers get a moment to fail on their
    own, then the launcher terminates them. `RankFailedError` names the rank that failed first, with its traceback
    or the signal that killed it. Collectives time out after `timeout_s`, so a rank that hangs ends the run too,
    by its peers' timeout errors. `fn` must be importable (a module-level function) and its result picklable.

    SIGTERM and SIGUSR1 sent to this process while the ranks run are passed on to every rank (a scheduler
    signals the launcher before it kills the job: the ranks may finish their step and save, see
    fsdp_graph.StopSignal); Ctrl-C ends every rank at once (ranks ignore SIGINT: the launcher ends them).

    With FSDP_GRAPH_GLOO_THREADS=N set, each rank's gloo groups run on N worker threads instead of torch's 2 (the
    test suite sets 1: its references keep several collectives in flight on them, which on two threads can
    corrupt the heap, see fsdp_graph.runtime.gloo). A rank that crashes in native code is reported with the
    Python stacks faulthandler wrote at the crash.
    """
    _gloo_threads()  # a malformed value fails here, before any rank starts
    # The parent owns the rendezvous store, bound to a port the OS picks and held for the whole run: no window in
    # which another process could take the port between choosing and binding it.
    store = dist.TCPStore(
        _HOST, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )
    start_method = _start_method(fn)
    env = {**os.environ, LAUNCHER_PID_ENV: str(os.getpid())}
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _entry,
            args=(fn, world, store.port, timeout_s, out_dir, args, env, (_CallersFd(1), _CallersFd(2))),
            nprocs=world,
            join=False,
            start_method=start_method,
        )
        states: dict[int, str] = {}
        try:
            with _forwarding_signals(context.processes):
                exits, running = _watch(context.processes, out_dir)
            states = {rank: _process_state(context.processes[rank].pid) for rank in running}
        finally:  # also on KeyboardInterrupt in the parent: no rank outlives the call
            _end(context.processes, list(range(world)))
            for path in context.error_files:  # torch's own copy of a traceback; ours is in out_dir
                if os.path.exists(path):
                    os.unlink(path)
        failures, killed_by = _failures(out_dir, world, exits, states)
        if failures:
            raise RankFailedError(failures, ended=tuple(running), signal=killed_by)
        results = []
        for rank in range(world):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
