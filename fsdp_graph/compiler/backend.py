"""`fsdp_backend`: THE pipeline (DESIGN §5). Dynamo graph -> dedup -> joint: reshard tags -> partition
-> forward/backward: lower to `_c10d_functional` -> Inductor (or eager kernels with `inductor=False`)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import inspect
import itertools
import os
import pkgutil
import time
import warnings
from collections import Counter

import torch
import torch._functorch.config as functorch_config
import torch.distributed as dist
import torch.fx as fx

import passes
from fsdp_graph import ir
from fsdp_graph.api.config import Compression
from fsdp_graph.compiler import compiled_files, gc_pause, stage_passes
from fsdp_graph.compiler.compiled_files import CompiledFiles
from fsdp_graph.compiler.deferred_header import deferred_header
from fsdp_graph.compiler.dump import DUMP_ENV, GraphDumper, no_caches_when_dumping
from fsdp_graph.compiler.grad_outputs import watch_gradients
from fsdp_graph.compiler.graph_facts import (
    check_compressible,
    check_sharded,
    dtensor_groups,
    gloo_groups,
    piece_rows,
    user_gloo_groups,
)
from fsdp_graph.compiler.options import OWNED_VALUES, inductor_config_patches, patches_key
from fsdp_graph.compiler.rank_check import STORE, RankAgreement, check_first_call
from fsdp_graph.compiler.region_schema import cached_region_schemas
from fsdp_graph.compiler.shared_compile import CompileSharing
from fsdp_graph.compiler.stage_passes import DEFAULT_SCHEDULE, GraphReport, LowerPass, ReshardPass, ScheduleOptions
from fsdp_graph.compiler.vec_isa import vec_isa_patches
from fsdp_graph.compiler.warm_up import load_compile_stack
from fsdp_graph.ir import ops


@functools.cache
def _code_hash() -> str:
    """Code of every module of `passes` and of the op semantics: a changed pass (or helper) never reuses stale code.
    Computed at the first compile, not at import: `import passes` imports this package (for `fsdp_graph.ir`) before
    `passes` is whole."""
    names = sorted(m.name for m in pkgutil.iter_modules(passes.__path__))
    # the stage passes and this module decide which passes run on which graph, and how a stage compiles
    here = [stage_passes, importlib.import_module(__name__)]
    modules = [ops, ir, *here] + [importlib.import_module(f"passes.{name}") for name in names]
    h = hashlib.sha256()
    for module in modules:
        h.update(inspect.getsource(module).encode())
    return h.hexdigest()


class FSDPBackend:
    """A torch.compile backend. `reports` lists each lowered graph's collectives; `dynamo_graphs` counts
    the Dynamo graphs compiled (graph breaks and recompiles each add one). With `verify_collectives`, each
    compiled Dynamo graph checks on its first call that every rank compiled the same collectives
    (`fsdp_graph.compiler.rank_check`), waiting at most `verify_timeout_s` for the other ranks. With
    `share_compiles`, the first rank to reach a graph compiles it for the ranks with the same graph
    (`fsdp_graph.compiler.shared_compile`; `sharing.stats` counts what this rank compiled and loaded,
    `sharing.seconds` times its compiling, preparing, waiting and loading).
    With torch's compile caches on, a graph compiled before (by another rank, or an earlier compile on this machine)
    is served from them, eager kernels included (`_compile_eager`), and `reports` then holds what the passes reported
    when they compiled it (`GraphReport.loaded_from`). `compiled` keeps what each compile left in those caches, by
    graph (`compiled_files.recording`), for `save_checkpoint(compiled=backend)` (Inductor's); `restored` counts the
    graphs and kernel files `load_checkpoint(compiled=backend)` installed."""

    def __init__(
        self,
        *,
        inductor: bool = True,
        dump_dir: str | None = None,
        keep_graphs: bool = False,
        schedule: ScheduleOptions = DEFAULT_SCHEDULE,
        verify_collectives: bool = True,
        verify_timeout_s: float = 600.0,
        share_compiles: bool = True,
    ):
        self.inductor = inductor
        self.share_compiles = share_compiles
        self.sharing = CompileSharing()
        # graph key -> what its compile left in torch's caches (one dict: the sharing fills it where it applies)
        self.compiled: dict[str, CompiledFiles] = self.sharing.files
        self.restored: Counter = Counter()
        # torch.compile's `mode=`/`options=` (as `patches_key` text) this backend's compiles ran with, saved in a
        # checkpoint's compiled header; and, once `load_checkpoint(compiled=self)` installed artifacts, where they came
        # from and what they were compiled with (torch.compile passes them only when it compiles: checked then)
        self.compile_options: set[str] = set()
        self.restored_options: tuple[str, frozenset[str]] | None = None
        self.verify_collectives, self.verify_timeout_s = verify_collectives, verify_timeout_s
        self.agreement = RankAgreement(verify_timeout_s)  # the lists this backend's ranks agreed on, per group
        self.dump_dir = dump_dir
        self.keep_graphs = keep_graphs
        self.schedule = schedule
        self.reports: list[GraphReport] = []
        self.dynamo_graphs = 0
        self.pass_seconds: Counter = Counter()  # wall time spent in our passes, per pass, over every compile
        self._counter = itertools.count()
        self._uuid: str | None = None  # `_cache_key()`, made at the first compile

    def __call__(self, gm: fx.GraphModule, example_inputs, *, mode: str | None = None, options: dict | None = None):
        """Dynamo calls this with torch.compile's `mode` and `options` (when given) as keyword arguments."""
        # The collector's pause from the compile's start needs Dynamo's callbacks, which torch._dynamo.reset() clears
        # (after fully_shard installed them): the compiles after this one get them back, and this one's backend part
        # runs paused in any case.
        gc_pause.install()
        with gc_pause.paused():
            return self._compile(gm, example_inputs, mode, options)

    def _compile(self, gm: fx.GraphModule, example_inputs, mode: str | None, options: dict | None):
        inductor_patches = inductor_config_patches(mode, options, self.inductor)
        self._check_restored_options(patches_key(inductor_patches))
        dumper = GraphDumper(self.dump_dir, next(self._counter))
        self.dynamo_graphs += 1
        dumper.graph("00_dynamo", gm)
        check_sharded(gm, example_inputs)
        start = time.perf_counter()
        passes.lift_region_mutations(gm)  # before AOT autograd, which refuses to train a body writing its input
        passes.dedup_unshard(gm)
        self.pass_seconds["dedup"] += time.perf_counter() - start
        dumper.graph("01_dedup", gm)
        if self.schedule.compress is not None:
            check_compressible(gm, self.schedule.compress)
        fsdp_gloo = gloo_groups(gm)
        all_to_all = frozenset() if self.schedule.reduce_scatter == "native" else fsdp_gloo
        tp_groups = dtensor_groups(gm, example_inputs)  # tensor parallelism's groups, as the graphs name them
        # serial too: expert parallelism's all-to-alls, a user's all-reduce
        gloo = fsdp_gloo | {tp_groups.names.get(g, g) for g in user_gloo_groups(gm)}
        # The process groups' backends decide the lowering, and torch.compile's options what Inductor makes of it:
        # both are part of the compiled code's cache key; so are, under compression (which packs by them), the node
        # groups' piece sizes, which the backward graph does not show.
        pieces = piece_rows(gm) if self.schedule.compress is not None else {}
        key = f"{self._cache_key()}{sorted(all_to_all)}{sorted(gloo)}{patches_key(inductor_patches)}"
        key += tp_groups.key()
        if pieces:
            key += f"{sorted(pieces.items())}"
        uuid = hashlib.sha256(key.encode()).hexdigest()
        reshard = ReshardPass(uuid, dumper, self.pass_seconds)
        lower = LowerPass(
            uuid,
            dumper,
            self.reports,
            self.schedule,
            self.keep_graphs,
            all_to_all,
            self.pass_seconds,
            gloo,
            pieces,
        )
        budget = self.schedule.activation_memory_budget
        functorch_patches = {} if budget is None else {"activation_memory_budget": budget}
        verify = self.verify_collectives and dist.is_initialized() and dist.get_world_size() > 1
        # torch's compile caches serve a graph compiled before (AOT autograd's entry; Inductor's FX graph entries and
        # kernels): with eager kernels too, where AOT autograd's entry holds the lowered graphs. Not for kept graphs:
        # `explain` reads the graphs the passes leave, which a cache entry does not hold.
        cached = not dumper.enabled and compiled_files.caches_on() and (self.inductor or not self.keep_graphs)
        share = self.share_compiles and cached and CompileSharing.applies()
        if verify or cached:  # the backward compiles now (not at its first run): the first forward checks it too,
            functorch_patches["force_non_lazy_backward_lowering"] = True  # and its files and reports are kept

        def compile_graph(caches: bool = True):
            with (
                no_caches_when_dumping(dumper.enabled or not caches),
                functorch_config.patch(functorch_patches),
                cached_region_schemas(),
            ):
                if self.inductor:
                    return _compile_inductor(
                        gm,
                        example_inputs,
                        reshard,
                        lower,
                        tp_groups.names,
                        dumper.enabled or not caches,
                        inductor_patches,
                    )
                return _compile_eager(gm, example_inputs, reshard, lower, tp_groups.names, cached and caches)

        reads = passes.gathered_reads(gm)  # before AOT autograd, on the graph whose outputs the caller sees
        if not verify and not cached:
            return watch_gradients(compile_graph(), reads)
        store_key = STORE.key(uuid, gm, example_inputs)
        index = dumper.graph_index

        def compile_checked():
            first = len(self.reports)
            compiled = self._compile_reported(compile_graph, index, store_key, lower.stages_compiled, cached)
            if not verify:
                return compiled
            lists = [r.collectives_to_compare() for r in self.reports[first:] if r.graph_index == index]
            return check_first_call(compiled, lambda: lists, self.agreement)

        if share:  # the sharing records what this rank's compile left in the caches
            compiled = self.sharing.compile(
                store_key,
                f"Dynamo graph {index}",
                compile_checked,
                lambda: STORE.load(store_key),
                lambda entry: STORE.save(store_key, entry["rank"], entry["reports"]),
                functools.partial(load_compile_stack, self.inductor),
            )
        elif cached:
            with compiled_files.recording() as files:
                compiled = compile_checked()
            self.compiled[store_key] = files
        else:
            compiled = compile_checked()
        return watch_gradients(compiled, reads)

    def _compile_reported(self, compile_graph, index: int, store_key: str, stages_compiled: list[str], cached: bool):
        """Compiles graph `index`, so that `reports` has its stages' reports. Where torch's caches served it (our
        passes did not run), they are what the passes reported when they compiled the cached code, from
        `rank_check.STORE` (written there by that compile, another rank's through the sharing, or a checkpoint's
        artifacts), marked `loaded_from`. A hit with none stored compiles again without the caches (once: they are
        then stored). So does a partial hit: some stage compiled by our passes, another served by an FX graph cache
        entry that a concurrent process (another job, or a rank) wrote while this one compiled; its reports would
        lack that stage."""
        first = len(self.reports)

        def lowered() -> list[GraphReport]:
            return [r for r in self.reports[first:] if r.graph_index == index]

        compiled = compile_graph()
        stored = None if lowered() else STORE.load(store_key)
        if stored is not None:
            self.reports.extend(GraphReport.from_json(data, index, stored["rank"]) for data in stored["reports"])
            return compiled
        if not (lowered() and set(stages_compiled) <= {r.stage for r in lowered()}):
            self.reports[first:] = [r for r in self.reports[first:] if r.graph_index != index]
            del stages_compiled[:]
            compiled = compile_graph(caches=False)
        if cached:
            rank = dist.get_rank() if dist.is_initialized() else 0
            STORE.save(store_key, rank, [r.to_json() for r in lowered()])
        return compiled

    def _check_restored_options(self, options: str) -> None:
        """Records the compile's torch.compile options; where installed artifacts were compiled with others, says so
        in one line (once): torch's cache keys miss them, and the graph compiles."""
        self.compile_options.add(options)
        if self.restored_options is None:
            return
        where, saved = self.restored_options
        if saved and options not in saved:
            self.restored_options = None
            if not dist.is_initialized() or dist.get_rank() == 0:
                warnings.warn(
                    f"load_checkpoint: compiled artifacts in {where} ignored: compiled with torch.compile options "
                    f"{' | '.join(_described(o) for o in sorted(saved))}, this compile has {_described(options)}; "
                    "compiling as without them",
                    stacklevel=2,
                )

    @property
    def keeps_compiled(self) -> bool:
        """Its compiles fill `compiled` (Inductor, not dumping graphs; torch's caches on at compile time)."""
        return self.inductor and not (self.dump_dir or os.environ.get(DUMP_ENV))

    @staticmethod
    def passes_hash() -> str:
        """A hash of the passes' code (and the op semantics they rely on)."""
        return _code_hash()

    def _cache_key(self) -> str:
        """The passes' code and this backend's options: what every compiled graph's cache key includes."""
        if self._uuid is None:
            options = repr(sorted({"inductor": self.inductor, "schedule": repr(self.schedule)}.items()))
            self._uuid = hashlib.sha256(f"{_code_hash()}{options}".encode()).hexdigest()
        return self._uuid

    def __repr__(self) -> str:
        return f"fsdp_backend(inductor={self.inductor}, dump_dir={self.dump_dir!r})"


def _compile_inductor(
    gm,
    example_inputs,
    reshard: ReshardPass,
    lower: LowerPass,
    group_names: dict[str, str],
    dumping: bool,
    user_patches: dict | None = None,
):
    """Inductor's compile of `gm` with our passes. Each stage's groups are renamed (`group_names`, c10d's name -> the
    graphs', `graph_facts.dtensor_groups`) as its compile starts: Inductor keys its FX graph cache on the graph
    before it runs our post-grad pass."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(graph, inputs, **kwargs):
        lower.stage = "bw" if kwargs.get("is_backward") else ("inference" if kwargs.get("is_inference") else "fw")
        lower.stages_compiled.append(lower.stage)
        passes.rename_groups(graph, group_names)
        return compile_fx_inner(graph, inputs, **kwargs)

    # Inductor's peak-memory reordering re-sorts the scheduler's nodes and sinks prefetched gathers to their first
    # use; the node order `passes.schedule` produced is the schedule (docs/design-notes.md).
    patches = {
        **(vec_isa_patches() if _on_cpu(example_inputs) else {}),  # no per-process ISA probe (compiler/vec_isa.py)
        **(user_patches or {}),
        **OWNED_VALUES,
        "joint_custom_pre_pass": reshard,
        "post_grad_custom_pre_pass": lower,
    }
    if dumping:
        patches["fx_graph_cache"] = False
    # A kernel loaded from the cache needs no precompiled header: built only for a compiled one (deferred_header.py)
    with deferred_header() if _on_cpu(example_inputs) else contextlib.nullcontext():
        return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)


def _described(options: str) -> str:
    return f"({options})" if options else "(none: no mode, no options)"


def _on_cpu(example_inputs) -> bool:
    """Inductor compiles C++ kernels for the graph (some input is a CPU tensor)."""
    return any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in example_inputs)


def _any_op(name: str) -> bool:
    return True  # the lowered graphs call our ops and c10d's functional collectives, registered on import


# The node metadata a cached lowered graph keeps: only users' annotations (`fx.traceback.annotate`), which torch's
# regional compilation reads. The loaded graph runs as Python code and nothing reads the rest again: no pass runs
# on a hit, and its reports travel beside it. Pickling the fake values, stack traces and provenance was 70% of the
# pickle's time, which every compiling rank pays and every loading rank pays again (docs/design-notes.md).
_KEPT_META = frozenset({"custom"})


def _picklable_meta(key: str) -> bool:
    return key in _KEPT_META


def _compile_eager(
    gm, example_inputs, reshard: ReshardPass, lower: LowerPass, group_names: dict[str, str], cached: bool = False
):
    """AOT autograd with our passes and eager kernels: each stage's lowered graph runs as Python code. `cached`:
    AOT autograd's cache keeps the lowered graphs (its bundled entry, the graphs pickled by torch's GraphPickler,
    `RegionalOutputCode`), so a process compiling the same graph again (another rank, a later job) runs neither
    the partitioner nor our passes. Our passes' uuids enter its key as Inductor's would (the custom-pass slots of
    `torch._inductor.config`, which AOT autograd's key hashes; Inductor itself does not run)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def partition(joint, joint_inputs, **kwargs):
        reshard(joint.graph)
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    def compiler(stage: str):
        def compile_graph(graph: fx.GraphModule, inputs):
            lower.stage = stage
            lower.stages_compiled.append(stage)
            passes.rename_groups(graph, group_names)
            lower(graph.graph)
            if not cached:
                return make_boxed_func(graph.forward)
            from torch._inductor.output_code import RegionalOutputCode

            graph.recompile()
            return RegionalOutputCode(graph, ops_filter=_any_op, node_metadata_key_filter=_picklable_meta)

        return compile_graph

    compile_with = aot_autograd(
        fw_compiler=compiler("fw"),
        bw_compiler=compiler("bw"),
        inference_compiler=compiler("inference"),
        partition_fn=partition,
    )
    if not cached:
        return compile_with(gm, example_inputs)
    import torch._inductor.config as inductor_config

    with (
        functorch_config.patch(force_autograd_cache=True, bundled_autograd_cache=True),
        inductor_config.patch(post_grad_custom_pre_pass=lower, joint_custom_pre_pass=reshard),
    ):
        return compile_with(gm, example_inputs)


def make_backend(
    *,
    inductor: bool = True,
    dump_dir: str | None = None,
    prefetch: bool = True,
    max_inflight_bytes: int | None = None,
    bucket_bytes: int = 0,
    reduce_scatter: str = "auto",
    activation_memory_budget: float | None = None,
    keep_graphs: bool = False,
    verify_collectives: bool = True,
    verify_timeout_s: float = 600.0,
    compress: Compression | str | None = None,
    share_compiles: bool = True,
) -> FSDPBackend:
    """A new backend. `inductor=False` runs the same passes and executes with eager kernels (fast compile).
    `dump_dir` (or env FSDP_GRAPH_DUMP) writes each stage's graph as code plus a collective summary.
    `prefetch`: issue each gather early and sink reduction waits (`passes.schedule`), keeping the bytes of
    gathered-but-unfreed parameters under `max_inflight_bytes` (None: one unit more than the unscheduled graph).
    `bucket_bytes`: merge consecutive units' collectives up to this many bytes each (`passes.bucket`; 0: off).
    `reduce_scatter`: "auto" reduces gradients over gloo groups with an all-to-all and a local sum (gloo runs a
    reduce-scatter as an all-reduce: twice the bytes); "native" always uses `reduce_scatter_tensor`.
    `activation_memory_budget`: the share (0-1] of the activations the partitioner may save for backward; below 1 it
    recomputes the cheapest others (torch._functorch's solver), trading compute for peak memory. None: 1.0.
    `keep_graphs`: each report keeps a copy of its lowered graph (for `explain`).
    `verify_collectives`: on each compiled graph's first call, the rank compares its forward and backward
    collectives with those the other ranks compiled, through the default group's store (no collective: a
    recompile on one rank with the same collectives passes), and every rank raises, naming the graph and the first
    difference, if they differ (instead of hanging); `verify_timeout_s` bounds the wait for the other ranks.
    `compress`: quantized weight gathers and gradient all-to-alls (a `Compression`, or its `Compression.parse` text
    such as "int8"; None: off, the default), `passes.compress` between bucketing and scheduling.
    `share_compiles`: on several ranks with torch's compile caches on, the first rank to reach a graph compiles it
    and the ranks with the same graph load its cache entries (and Inductor's kernels) instead of compiling
    (`fsdp_graph.compiler.shared_compile`); they wait for it at most the default process group's timeout."""
    if reduce_scatter not in ("auto", "native"):
        raise ValueError(f"make_backend: reduce_scatter must be 'auto' or 'native', got {reduce_scatter!r}")
    if activation_memory_budget is not None and not 0 < activation_memory_budget <= 1:
        raise ValueError(f"make_backend: activation_memory_budget must be in (0, 1], got {activation_memory_budget}")
    if not verify_timeout_s > 0:
        raise ValueError(f"make_backend: verify_timeout_s must be a positive number of seconds, got {verify_timeout_s}")
    if isinstance(compress, str):
        compress = Compression.parse(compress)
    if compress is not None and not isinstance(compress, Compression):
        raise TypeError(f"make_backend: compress must be a Compression, its text or None, got {compress!r}")
    options = ScheduleOptions(
        prefetch, max_inflight_bytes, bucket_bytes, reduce_scatter, activation_memory_budget, compress
    )
    return FSDPBackend(
        inductor=inductor,
        dump_dir=dump_dir,
        keep_graphs=keep_graphs,
        schedule=options,
        verify_collectives=verify_collectives,
        verify_timeout_s=verify_timeout_s,
        share_compiles=share_compiles,
    )


fsdp_backend = make_backend()
