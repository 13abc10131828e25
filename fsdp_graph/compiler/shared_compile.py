"""One compile per job, not per rank (issue 36).

Ranks that trace the same Dynamo graph with the same inputs, options and torch compile the same code: every rank's
graph names the same process groups (fully_shard's groups under rank-independent names) and unit names, and every
flat shard has the same size (both layouts pad a unit to equal shards), so the code is rank-independent wherever the
graph is. So the first rank to reach a graph compiles it for every rank, and the others load what it compiled:

- The graph's key is the rank check's (`rank_check.FingerprintStore.key`: the backend's options and pass code, the
  Dynamo graph's code, every input's metadata, torch's version and configs, the grad mode and thread count). A rank
  claims it in the default group's store (`compare_set`); the first claim wins.
- The claiming rank compiles, capturing the cache entries and kernel libraries of that compile
  (`compiled_files.recording`), and publishes them under the key with its passes' reports of the graph (whose
  collective lists the rank check compares); it counts a heartbeat in the store while it compiles.
- Every other rank reaching the key waits for the publication, installs the files into its own caches
  (`compiled_files.install`) and compiles: torch's AOT autograd and FX graph caches then serve the graph (no
  partitioning, no passes, no Inductor, no C++ compiler). With eager kernels (`make_backend(inductor=False)`) the
  AOT autograd entry alone holds the lowered graphs, and no AOT autograd runs there either. Which code runs is
  still decided by torch's own cache keys: if anything torch keys on differs on this rank, its cache misses and it
  compiles its own graph.
- Ranks whose graphs differ (pipeline stages, tp ranks of another tp coordinate, a rank recompiling alone) have
  different keys and compile their own, without waiting. fully_shard's own groups are named alike on every rank
  (`api.groups.rank_independent_name`), and so are the DTensor groups in the compiled graphs
  (`graph_facts.dtensor_groups`), so HYBRID's ranks, a mesh slice's groups and the tp ranks of one coordinate share.

A waiting rank fails, naming the compiling rank and the graph, when that rank reports a compile error, when its
heartbeat stops for `stale_s` (its process ended: a launcher usually ends the job first), or after the job's
timeout (the default process group's). docs/design-notes.md has what this means for the rank check.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fsdp_graph.compiler import compiled_files
from fsdp_graph.compiler.compiled_files import CompiledFiles


class SharedCompileError(RuntimeError):
    """The rank compiling a graph for this one failed, ended or did not finish in time."""


_DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)  # torch's default for gloo groups
# A waiting rank checks for the compiled files after these pauses, growing: one store op a second at most
_FIRST_POLL_S, _LAST_POLL_S = 0.05, 1.0


def job_timeout_s() -> float:
    """The default process group's collective timeout (the longest of its backends'), in seconds."""
    group = dist.distributed_c10d._get_default_group()
    timeouts = []
    for device in getattr(group, "_device_types", []):
        try:
            timeouts.append(group._get_backend(device).options._timeout)
        except (RuntimeError, AttributeError):
            continue
    return max(timeouts, default=_DEFAULT_TIMEOUT).total_seconds()


class CompileSharing:
    """One backend's side of the sharing on this rank. `stats` counts graphs this rank compiled for others
    ("compiled"), loaded from another rank ("loaded") and the kernel libraries it installed ("kernels");
    `seconds` the wall time of each phase: compiling for the others ("compiling"), doing what a compile from the
    caches does once per process before waiting for another rank's files ("preparing"), waiting ("waiting"),
    installing them and compiling from the caches they fill ("loading")."""

    def __init__(self, timeout_s: float | None = None, stale_s: float = 120.0, heartbeat_s: float = 2.0):
        self.timeout_s, self.stale_s, self.heartbeat_s = timeout_s, stale_s, heartbeat_s
        self.stats: Counter = Counter()
        self.seconds: Counter = Counter()
        self.files: dict[str, CompiledFiles] = {}  # key -> what this rank's compile of it left in the caches

    @staticmethod
    def applies() -> bool:
        """Several real ranks (not the fake group of graph tests) and torch's compile caches on."""
        if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
            return False
        return compiled_files.caches_on()

    def compile(
        self,
        key: str,
        name: str,
        compile_fn: Callable[[], Any],
        reports: Callable[[], dict | None],
        install_reports: Callable[[dict], None],
        prepare: Callable[[], None] | None = None,
    ) -> Any:
        """`compile_fn()`, on the first rank to reach `key`; other ranks wait for its files, install them (and its
        passes' reports, through `install_reports`, where the compile served from them finds them) and then run
        `compile_fn()`, which the caches serve. `reports()` gives what the compiling rank's passes reported of the
        graph (`rank_check.STORE`'s entry: the rank and its reports as JSON; None: not made). A waiting rank runs
        `prepare()` first (`warm_up.load_compile_stack`: the compile's one-time work), while the compiling rank works."""
        store = _default_store()
        base = f"{_scope()}/{key}"
        rank = dist.get_rank()
        owner = int(store.compare_set(f"{base}/owner", "", str(rank)).decode())
        start = time.perf_counter()
        if owner == rank:
            compiled = self._compile_for_all(store, base, key, compile_fn, reports)
            self.seconds["compiling"] += time.perf_counter() - start
            return compiled
        if prepare is not None:
            prepare()
            self.seconds["preparing"] += time.perf_counter() - start
            start = time.perf_counter()
        files, published = self._wait_for(store, base, owner, name)
        waited = time.perf_counter()
        self.seconds["waiting"] += waited - start
        self.stats["kernels"] += compiled_files.install(files)
        if published.get("reports") is not None:
            install_reports(published["reports"])
        self.stats["loaded"] += 1
        with compiled_files.recording() as mine:
            compiled = compile_fn()
        self.files[key] = mine
        self.seconds["loading"] += time.perf_counter() - waited
        return compiled

    def _compile_for_all(self, store: dist.Store, base: str, key: str, compile_fn, reports) -> Any:
        stop = threading.Event()
        beat = threading.Thread(target=_heartbeat, args=(store, f"{base}/alive", stop, self.heartbeat_s), daemon=True)
        beat.start()
        try:
            with compiled_files.recording() as files:
                compiled = compile_fn()
        except BaseException as error:
            store.set(f"{base}/meta", json.dumps({"error": f"{type(error).__name__}: {error}"[:4000]}))
            raise
        finally:
            stop.set()
            beat.join()
        self.files[key] = files
        kernels = sorted(files.kernels)
        for index, relative in enumerate(kernels):
            store.set(f"{base}/kernel/{index}", files.kernels[relative])
        if files.artifacts is not None:
            store.set(f"{base}/artifacts", files.artifacts)
        meta = {
            "torch": torch.__version__,
            "machine": files.machine,
            "kernels": kernels,
            "artifacts": files.artifacts is not None,
            "reports": reports(),
        }
        store.set(f"{base}/meta", json.dumps(meta))  # last: what the waiting ranks wait for
        self.stats["compiled"] += 1
        return compiled

    def _wait_for(self, store: dist.Store, base: str, owner: int, name: str) -> tuple[CompiledFiles, dict]:
        timeout_s = self.timeout_s if self.timeout_s is not None else job_timeout_s()
        start = time.monotonic()
        last_beat, last_change, next_beat_check, pause = -1, start, start, _FIRST_POLL_S
        who = f"rank {owner}, which compiles {name} for every rank with the same graph,"
        # Polled, not one `store.wait`: a wait holds the store client until it returns, so nothing could check the
        # compiling rank's heartbeat meanwhile, and waits in slices make c10d log a warning per slice.
        while True:
            try:
                if store.check([f"{base}/meta"]):
                    break
                now = time.monotonic()
                if now >= next_beat_check:
                    beat, next_beat_check = store.add(f"{base}/alive", 0), now + self.stale_s / 8
                    if beat != last_beat:
                        last_beat, last_change = beat, now
            except dist.DistError as error:
                raise SharedCompileError(
                    f"fsdp_graph: {who} cannot be waited for: the job's store failed ({error}); the rank hosting it "
                    "has probably ended"
                ) from error
            if now - last_change > self.stale_s:
                raise SharedCompileError(
                    f"fsdp_graph: {who} has given no sign of life for {now - last_change:.0f} s (its process ended, "
                    "or hangs); this rank stops waiting for it. make_backend(share_compiles=False) compiles on "
                    "every rank."
                )
            if now - start >= timeout_s:
                raise SharedCompileError(
                    f"fsdp_graph: {who} did not finish within the job's timeout ({timeout_s:g} s, the default "
                    "process group's). make_backend(share_compiles=False) compiles on every rank."
                )
            time.sleep(pause)
            pause = min(pause * 1.5, _LAST_POLL_S)
        meta = json.loads(store.get(f"{base}/meta"))
        if "error" in meta:
            raise SharedCompileError(f"fsdp_graph: {who} failed: {meta['error']}")
        if meta["torch"] != torch.__version__:
            return CompiledFiles(), {}  # another torch: nothing it compiled applies here
        mine = compiled_files.machine_id()
        kernels = {}
        if meta["machine"] == mine:  # libraries this rank has are not fetched
            root = compiled_files._cache_dir()
            for index, relative in enumerate(meta["kernels"]):
                if not (root / relative).exists():
                    kernels[relative] = store.get(f"{base}/kernel/{index}")
        artifacts = store.get(f"{base}/artifacts") if meta["artifacts"] else None
        return CompiledFiles(artifacts, kernels, meta["machine"]), meta


def _heartbeat(store: dist.Store, key: str, stop: threading.Event, every_s: float) -> None:
    while True:
        try:
            store.add(key, 1)
        except Exception:  # the store is gone: the waiting ranks learn it from their own store calls
            return
        if stop.wait(every_s):
            return


def _default_store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


_scopes: dict[str, Any] = {"world": None, "scope": "", "count": 0}


def _scope() -> str:
    """Store keys per default process group: a group made again in the same processes (a second run of a test, a
    restart inside one job) never reads the first one's claims. Every rank makes its default groups in the same
    order, so the number is the same on every rank."""
    world = dist.distributed_c10d._get_default_group()
    current = _scopes["world"]
    if current is None or current() is not world:
        _scopes["world"] = weakref.ref(world)
        _scopes["scope"] = f"fsdp_graph/compile/{_scopes['count']}"
        _scopes["count"] += 1
    return _scopes["scope"]
