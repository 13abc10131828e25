"""Ranks agree on each compiled graph's collectives before its first run, out of band (issues 11 and 24).

A rank that compiled a different graph (a recompile, a graph break or an option on that rank only) would issue a
different collective sequence: a hang, or buffers of different sizes summed together. So on the first call of each
compiled Dynamo graph, the rank compares the SHA-256 digest of its forward and backward graphs' collective lists
(`passes.collective_fingerprint`, group names replaced by group shapes) with the lists the other ranks of each group
it communicates on have compiled, through the default group's c10d store: no collective, so a graph that only some
ranks compile (one rank recompiling alone for a shorter last batch) cannot pair with a peer's collective.

Per backend (`RankAgreement`, keys scoped by a per-process number taken at the backend's first check) and group (its
ranks), every rank keeps the digests the group has agreed on, in the order it agreed on them:
- a digest already agreed on passes after one store op (the published-mismatch check): a recompile with the same
  collectives, on any subset of the ranks;
- a new digest is the group's next variant: the first rank to publish it (`compare_set`) is the reference; a rank
  whose digest differs raises at once, and every rank waiting there raises with it; a rank whose digest matches
  counts itself in (`add`) and waits, at most `timeout_s`, until every rank of the group has (a new variant is only
  legitimate when every rank compiles it: no_sync, a data-dependent branch, the first compile). A new variant that
  the other ranks never compile ends in the timeout, with an error naming the nearest agreed graph's difference.
A mismatch is recorded under the backend's scope (first text wins), and every rank raises that text: the ranks at a
check raise it there; a rank that never compiles a new graph is caught inside a compiled forward, in the collective
the missing rank never joins, and raises it when that collective fails (as soon as the raising rank's process ends,
else at the process group's timeout). The store ops per new graph do not grow with the world size (none per
peer). docs/design-notes.md has the guarantees and their limits (NCCL, a failure outside a compiled forward).
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import json
import os
import re
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.fx as fx


@dataclass(frozen=True)
class GraphCollectives:
    """One compiled graph's collective sequence: `name` as "fw 0" / "bw 0" (stage, Dynamo graph index), `lines`
    from `passes.collective_fingerprint`, `groups` the process-group names it issues on."""

    name: str
    lines: tuple[str, ...]
    groups: tuple[str, ...]

    @property
    def stage(self) -> str:
        """ "fw", "bw" or "inference": what ranks compare (the index may differ when a rank compiled an extra graph
        without collectives, e.g. one that only rank 0 traces)."""
        return self.name.split()[0]


class CollectiveMismatchError(RuntimeError):
    """Ranks compiled graphs whose collectives differ; every rank of the run raises the same text."""


def digest(graphs: Sequence[GraphCollectives]) -> bytes:
    text = "\n".join(f"{g.stage}:{'|'.join(g.lines)}" for g in graphs)
    return hashlib.sha256(text.encode()).digest()


def first_difference(ranks: tuple[int, int], lists: tuple[Sequence[GraphCollectives], Sequence[GraphCollectives]]):
    """Text naming the first graph and collective where two ranks' lists differ (None if they are equal)."""
    (ra, rb), (a, b) = ranks, lists
    for index in range(max(len(a), len(b))):
        ga, gb = (a[index] if index < len(a) else None), (b[index] if index < len(b) else None)
        if ga is None or gb is None or ga.stage != gb.stage:
            da, db = (f"graph '{g.name}'" if g else "no graph" for g in (ga, gb))
            return f"compiled graph #{index + 1}: rank {ra} has {da}, rank {rb} has {db}"
        for position in range(max(len(ga.lines), len(gb.lines))):
            la = ga.lines[position] if position < len(ga.lines) else "nothing"
            lb = gb.lines[position] if position < len(gb.lines) else "nothing"
            if la != lb:
                counts = f"{len(ga.lines)} vs {len(gb.lines)} collectives"
                name = f"'{ga.name}'" + ("" if gb.name == ga.name else f" (rank {rb}: '{gb.name}')")
                return f"graph {name} collective #{position + 1} ({counts}): rank {ra} {la} vs rank {rb} {lb}"
    return None


_HEAD = "fsdp_graph: ranks compiled different collectives, running them would hang or mix up buffers: "
_TAIL = (
    ". Every rank must compile the same model with the same backend options (a recompile or graph break on one rank "
    "only?); fsdp_graph.make_backend(verify_collectives=False) turns this check off."
)
_AGREED = "ok"
# One number per backend and process group, taken at the backend's first check: the same on every rank, which
# create and first run their backends in the same order.
_SCOPES = itertools.count()


class RankAgreement:
    """One backend's side of the check on this rank: the store keys it uses and, per group (its sorted ranks), the
    digests the group agreed on, in order (the next new digest is the group's variant number len(...))."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._world: weakref.ref | None = None
        self._scope = ""
        self._agreed: dict[tuple[int, ...], dict[str, list[GraphCollectives]]] = {}

    def verify(self, graphs: Sequence[GraphCollectives]) -> None:
        """Raises CollectiveMismatchError if the ranks sharing these graphs' groups compiled other collectives.
        Store ops: one when every group agreed on this digest before, else about four per group (six for the rank
        that publishes or completes a variant), whatever the group's size."""
        if not any(g.groups for g in graphs) or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        if dist.get_backend() == "fake":
            return  # the fake group of graph tests, whose collectives move nothing
        # Over the groups the graphs use, not the world: ranks outside them run other graphs (another pipeline
        # stage's) and need not agree. Equality is transitive: agreeing in every shard and replicate group of a
        # HYBRID mesh means the whole mesh agrees.
        groups = [tuple(sorted(dist.get_process_group_ranks(g))) for g in exchange_groups(graphs)]
        if not groups:
            return
        store = self._store()
        recorded = self._recorded(store)
        if recorded is not None:
            raise CollectiveMismatchError(recorded)
        lists = [_rank_independent(graph) for graph in graphs]
        mine, rank = digest(lists).hex(), dist.get_rank()
        new = []  # (ranks, store key of the variant) for each group that has not agreed on `mine` yet
        for ranks in groups:
            agreed = self._agreed.setdefault(ranks, {})
            if mine not in agreed:
                new.append((ranks, f"{self._scope}/{_ranks_key(ranks)}/{len(agreed)}"))
        # Publish or compare in every group before waiting in any: a rank waiting in one group while a peer waits
        # for it in another would stall both until the timeout.
        references = []
        for _, base in new:
            reference, publisher = store.compare_set(f"{base}/digest", "", f"{mine} {rank}").decode().split()
            references.append((base, reference, int(publisher)))
            if reference == mine and int(publisher) == rank:
                store.set(f"{base}/lists", _to_json(lists))
        for base, reference, publisher in references:
            if reference != mine:
                self._fail(store, _HEAD + self._difference(store, base, publisher, lists) + _TAIL, new)
        for ranks, base in new:
            if store.add(f"{base}/arrived", 1) == len(ranks):
                store.set(f"{base}/result", _AGREED)
        deadline = time.monotonic() + self.timeout_s
        for ranks, base in new:
            left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
            try:
                store.wait([f"{base}/result"], left)
            except dist.DistStoreError:
                self._fail(store, self._timeout_text(store, ranks, base, lists), new)
            result = store.get(f"{base}/result").decode()
            if result != _AGREED:
                raise CollectiveMismatchError(result)
            self._agreed[ranks][mine] = lists

    def raise_recorded(self, error: BaseException) -> None:
        """After a compiled graph failed (a collective a peer never joined): raises the run's recorded mismatch
        from `error`, if a rank recorded one."""
        try:
            current = self._world is not None and self._world() is _default_group()
            recorded = self._recorded(_default_store()) if current else None
        except Exception:  # the group or its store is gone too (its host ended): `error` is all there is
            return
        if recorded is not None:
            raise CollectiveMismatchError(recorded) from error

    def _store(self) -> dist.Store:
        """The default group's store; a new process group (or the first check) takes a new scope."""
        world = _default_group()
        if self._world is None or self._world() is not world:
            self._world, self._scope, self._agreed = weakref.ref(world), f"fsdp_graph/rank_check/{next(_SCOPES)}", {}
        return _default_store()

    def _recorded(self, store: dist.Store) -> str | None:
        """The mismatch a rank of this scope recorded, if any (one store op when there is none)."""
        key = f"{self._scope}/mismatch"
        return store.get(key).decode() if store.check([key]) else None

    def _fail(self, store: dist.Store, text: str, new: list[tuple[tuple[int, ...], str]]) -> None:
        """Records `text` (the first rank's text wins), wakes the ranks waiting in this rank's new variants, raises."""
        recorded = store.compare_set(f"{self._scope}/mismatch", "", text).decode()
        for _, base in new:
            store.compare_set(f"{base}/result", "", recorded)
        raise CollectiveMismatchError(recorded)

    def _difference(self, store: dist.Store, base: str, publisher: int, lists: list[GraphCollectives]) -> str:
        """The first difference between the variant's reference (the publisher's lists) and this rank's, the
        lower rank first (the same text whichever rank published)."""
        store.wait([f"{base}/lists"], datetime.timedelta(seconds=self.timeout_s))
        pair = sorted([(publisher, _from_json(store.get(f"{base}/lists"))), (dist.get_rank(), lists)])
        return first_difference((pair[0][0], pair[1][0]), (pair[0][1], pair[1][1])) or "(equal lists, other digests)"

    def _timeout_text(self, store: dist.Store, ranks: tuple[int, ...], base: str, lists: list[GraphCollectives]) -> str:
        """Why this rank's new variant found too few takers: the difference from the group's last agreed graph."""
        rank, arrived = dist.get_rank(), store.add(f"{base}/arrived", 0)
        names = " and ".join(f"'{g.name}'" for g in lists)
        text = (
            f"rank {rank} compiled {names}, whose collectives only {arrived} of the {len(ranks)} ranks of its group "
            f"({group_shape(ranks)} from rank {ranks[0]}) compiled within {self.timeout_s:g} s"
        )
        agreed = list(self._agreed[ranks].values())
        if agreed:
            peer = next(r for r in ranks if r != rank)
            text += f"; against the last graph they agreed on, {first_difference((peer, rank), (agreed[-1], lists))}"
        else:
            text += ": a rank compiled a different graph (or none), or is stuck"
        return f"{_HEAD}{text}{_TAIL} make_backend(verify_timeout_s=...) sets the wait."


def check_first_call(
    compiled: Callable, graphs: Callable[[], list[GraphCollectives]], agreement: RankAgreement
) -> Callable:
    """`compiled`, checking `graphs()` across ranks on its first call (Dynamo's boxed calling convention kept); a
    failure of any call raises the run's recorded mismatch instead, if there is one."""
    checked = False

    def run(*args):
        nonlocal checked
        if not checked:
            agreement.verify(graphs())
            checked = True
        try:
            return compiled(*args)
        except Exception as error:
            agreement.raise_recorded(error)
            raise

    if getattr(compiled, "_boxed_call", False):
        run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _default_group() -> dist.ProcessGroup:
    return dist.distributed_c10d._get_default_group()


def _default_store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def _ranks_key(ranks: tuple[int, ...]) -> str:
    return hashlib.sha256(repr(ranks).encode()).hexdigest()[:16]


def _to_json(graphs: Sequence[GraphCollectives]) -> str:
    return json.dumps([[g.name, list(g.lines), list(g.groups)] for g in graphs])


def _from_json(text: bytes) -> list[GraphCollectives]:
    return [GraphCollectives(name, tuple(lines), tuple(groups)) for name, lines, groups in json.loads(text)]


def exchange_groups(graphs: Sequence[GraphCollectives]) -> list[dist.ProcessGroup]:
    """One process group per distinct set of ranks the graphs communicate on (more than one rank), in the order
    of their collectives (not of `groups`, which is sorted by name: names, unlike roles, differ between ranks of
    different replicas). A graph's group, its single-thread gloo copy and its duplicate for reductions are one set."""
    names = [m.group(1) for graph in graphs for line in graph.lines for m in _GROUP_ARGUMENT.finditer(line)]
    seen: set[tuple[int, ...]] = set()
    groups = []
    for name in [*names, *(name for graph in graphs for name in graph.groups)]:
        group = _resolve(name)
        ranks = tuple(sorted(dist.get_process_group_ranks(group)))
        if len(ranks) > 1 and ranks not in seen:
            seen.add(ranks)
            groups.append(group)
    return groups


_GROUP_ARGUMENT = re.compile(r"\bgroup=([^,)]+)")


def _rank_independent(graph: GraphCollectives) -> GraphCollectives:
    """`graph` with each process-group name replaced by the group's shape: ranks of different replicas (HYBRID's
    replicate groups of a 2-D mesh, say) run the same collectives on different groups of one mesh dimension, whose
    names differ, so names cannot be compared across ranks."""
    shapes: dict[str, str] = {}
    for name in graph.groups:
        shapes[name] = group_shape(sorted(dist.get_process_group_ranks(_resolve(name))))
    lines = tuple(
        _GROUP_ARGUMENT.sub(lambda m: f"group={shapes.get(m.group(1), m.group(1))}", line) for line in graph.lines
    )
    return GraphCollectives(graph.name, lines, tuple(shapes[name] for name in graph.groups))


def group_shape(ranks: Sequence[int]) -> str:
    """A group as every member of its mesh dimension describes it: its size and its members' offsets from the
    lowest (ranks [0, 2] and [1, 3] of a 2x2 mesh are both "2 ranks, stride 2")."""
    offsets = [rank - ranks[0] for rank in ranks]
    stride = offsets[1] if len(offsets) > 1 else 1
    if offsets == [i * stride for i in range(len(offsets))]:
        return f"{len(offsets)} ranks, stride {stride}"
    return f"{len(offsets)} ranks at offsets {hashlib.sha256(repr(offsets).encode()).hexdigest()[:12]}"


def _resolve(name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


class FingerprintStore:
    """What our passes reported of each compiled Dynamo graph, kept where Inductor keeps its cache: on a compile-cache
    hit the passes do not run, so the cached code's reports (`GraphReport.to_json`, with the rank whose passes made
    them), and the collective lists the rank check compares, come from here (keyed by everything the passes see)."""

    def __init__(self) -> None:
        self._memory: dict[str, dict] = {}

    @staticmethod
    def key(backend_key: str, gm: fx.GraphModule, example_inputs: Sequence) -> str:
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        # The grad mode decides AOT autograd's graphs, the thread count Inductor's C++ kernels (both in torch's keys)
        grad, threads = torch.is_grad_enabled(), torch.get_num_threads()
        h = hashlib.sha256(f"{torch.__version__}{backend_key}{grad}{threads}".encode())
        for module in gm.modules():
            if isinstance(module, fx.GraphModule):
                h.update(module.code.encode())
        for value in example_inputs:
            if isinstance(value, torch.Tensor):
                meta = (
                    type(value).__name__,
                    value.shape,
                    value.stride(),
                    value.dtype,
                    value.device,
                    value.requires_grad,
                )
                h.update(repr(meta).encode())
            else:
                h.update(repr(type(value)).encode())
        for config in (functorch_config, inductor_config):
            h.update(repr(sorted(config.save_config_portable().items())).encode())
        return h.hexdigest()

    @staticmethod
    def _path(key: str) -> Path:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return Path(cache_dir()) / "fsdp_graph_reports" / f"{key}.json"

    def load(self, key: str) -> dict | None:
        """{"rank": the rank whose passes made them, "reports": [GraphReport JSON, ...]}, or None: none stored."""
        if key in self._memory:
            return self._memory[key]
        try:
            entry = json.loads(self._path(key).read_text())
            if not (isinstance(entry, dict) and isinstance(entry["rank"], int) and isinstance(entry["reports"], list)):
                return None
        except (OSError, ValueError, KeyError):
            return None
        self._memory[key] = entry
        return entry

    def save(self, key: str, rank: int, reports: list[dict]) -> None:
        entry = {"rank": rank, "reports": reports}
        if self._memory.get(key) == entry:
            return
        self._memory[key] = entry
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(entry, f)
        os.replace(f.name, path)


STORE = FingerprintStore()
