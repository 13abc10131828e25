"""Ranks agree on each compiled graph's collectives before its first run (issue 11).

A rank that compiled a different graph (a recompile, a graph break or an option on that rank only) would issue a
different collective sequence: a hang, or buffers of different sizes summed together. On the first call of each
compiled Dynamo graph, every rank all-gathers a 32-byte digest of its forward and backward graphs' collective lists
(`passes.collective_fingerprint`); only when the digests differ do they exchange the lists, and every rank raises
the same error naming the graph and the first difference.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.fx as fx

from fsdp_graph.runtime.devices import collective_device


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
    """Ranks compiled graphs whose collectives differ; raised on every rank of the exchange."""


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


def _gather_digests(mine: bytes, group: dist.ProcessGroup | None, timeout_s: float, label: str) -> list[bytes]:
    device = collective_device(group)
    local = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(gathered, local, group=group, async_op=True)
    try:
        work.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as error:
        raise CollectiveMismatchError(
            f"fsdp_graph: rank {dist.get_rank()} waited {timeout_s:.0f} s for the other ranks to check the "
            f"collectives of {label}: a rank compiled a different graph (or none), or is stuck. "
            "make_backend(verify_timeout_s=...) sets the wait."
        ) from error
    return [bytes(t.cpu().tolist()) for t in gathered]


def verify_ranks_agree(graphs: Sequence[GraphCollectives], timeout_s: float) -> None:
    """Raises CollectiveMismatchError on every rank if the ranks sharing these graphs' groups compiled other
    collectives. One 32-byte all-gather per group the graphs communicate on (groups of the same ranks once); the
    full lists travel only on a mismatch."""
    names = {group for graph in graphs for group in graph.groups}
    if not names or not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return  # nothing to agree on; or the fake group of graph tests, whose collectives move nothing
    label = " and ".join(f"graph '{g.name}'" for g in graphs)
    mine = digest([_rank_independent(graph) for graph in graphs])
    # Over the groups the graphs use, not the world: ranks outside them may run other graphs (another pipeline
    # stage's) or be blocked on this rank (a pipeline receive), and need not agree. HYBRID's shard and replicate
    # groups are checked one after the other, in the order the graphs first use them (the same on every rank that
    # compiled the same graphs); equality is transitive, so the whole mesh agrees. A rank finishes its exchanges
    # before raising, so the members of its later groups are not left waiting for it.
    error = None
    for group in exchange_groups(graphs):
        digests = _gather_digests(mine, group, timeout_s, label)
        if len(set(digests)) > 1:
            error = error or _mismatch(graphs, group, digests)
    if error is not None:
        raise error


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


def _mismatch(
    graphs: Sequence[GraphCollectives], group: dist.ProcessGroup, digests: list[bytes]
) -> CollectiveMismatchError:
    """The error every member of `group` raises (the same text): the lists travel, from the lowest group member
    and the first member that differs from it."""
    graphs = [_rank_independent(graph) for graph in graphs]
    lists: list = [None] * len(digests)
    dist.all_gather_object(lists, [(g.name, g.lines, g.groups) for g in graphs], group=group)
    other = next(i for i, d in enumerate(digests) if d != digests[0])
    a, b = ([GraphCollectives(*item) for item in lists[i]] for i in (0, other))
    ranks = (dist.get_global_rank(group, 0), dist.get_global_rank(group, other))
    difference = first_difference(ranks, (a, b)) or "(lists equal, digests differ)"
    return CollectiveMismatchError(
        f"fsdp_graph: ranks compiled different collectives, running them would hang or mix up buffers: "
        f"{difference}. Every rank must compile the same model with the same backend options (a recompile or "
        "graph break on one rank only?); fsdp_graph.make_backend(verify_collectives=False) turns this check off."
    )


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


def check_first_call(compiled: Callable, graphs: Callable[[], list[GraphCollectives]], timeout_s: float) -> Callable:
    """`compiled`, checking `graphs()` across ranks on its first call (Dynamo's boxed calling convention kept)."""
    checked = False

    def run(*args):
        nonlocal checked
        if not checked:
            verify_ranks_agree(graphs(), timeout_s)
            checked = True
        return compiled(*args)

    if getattr(compiled, "_boxed_call", False):
        run._boxed_call = True  # type: ignore[attr-defined]
    return run


class FingerprintStore:
    """Collective lists of compiled Dynamo graphs, kept where Inductor keeps its cache: on a compile-cache hit our
    passes do not run, so the lists of the cached code come from here (keyed by everything the passes see)."""

    def __init__(self) -> None:
        self._memory: dict[str, list[GraphCollectives]] = {}

    @staticmethod
    def key(backend_key: str, gm: fx.GraphModule, example_inputs: Sequence) -> str:
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        h = hashlib.sha256(f"{torch.__version__}{backend_key}".encode())
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

        return Path(cache_dir()) / "fsdp_graph_collectives" / f"{key}.json"

    def load(self, key: str) -> list[GraphCollectives] | None:
        if key in self._memory:
            return self._memory[key]
        try:
            items = json.loads(self._path(key).read_text())
        except (OSError, ValueError):
            return None
        graphs = [GraphCollectives(name, tuple(lines), tuple(groups)) for name, lines, groups in items]
        self._memory[key] = graphs
        return graphs

    def save(self, key: str, graphs: list[GraphCollectives]) -> None:
        if self._memory.get(key) == graphs:
            return
        self._memory[key] = graphs
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump([[g.name, list(g.lines), list(g.groups)] for g in graphs], f)
        os.replace(f.name, path)


STORE = FingerprintStore()
