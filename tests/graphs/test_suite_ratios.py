"""benchmarks/suite.py's ratio rows: paired within each run, min/median/max over the runs, and a skipped peer's
rows left out (no measurement of the ranks: these are the tables' arithmetic)."""

from benchmarks import compile_goals, suite, suite_tables


def _measured(names, runs=3):
    step = {name: 1.0 for name in names} | {suite.OURS: 0.5}
    return {
        "runs": [
            {name: {"median": step[name] * (1 + r), "peak": 100.0 if name == suite.OURS else 200.0} for name in names}
            for r in range(runs)
        ],
        "cold": {name: [10.0 if name == suite.OURS else 5.0] for name in names},
    }


def test_ratios_paired_per_run_and_skipped_peer_left_out():
    everyone = list(suite.PEERS)
    rows = {label: (values, target) for label, values, target in suite._ratios(_measured(everyone))}
    # The load of run r scales both sides of a ratio: paired, the ratio stays 0.5.
    assert rows["step time, ours / DDP"] == ([0.5, 0.5, 0.5], 1.0)
    assert rows["step time, ours / SimpleFSDP"] == ([0.5, 0.5, 0.5], None)
    assert rows["peak memory, ours / FSDP2 eager"] == ([0.5, 0.5, 0.5], None)
    assert rows["cold compile, ours / plain torch.compile"] == ([2.0], None)
    table = suite_tables.ratio_table(suite._ratios(_measured(everyone)))
    assert "| step time, ours / FSDP2 eager | 3 | 0.50 | 0.50 | 0.50 | <= 0.85 | yes |" in table
    assert "| cold compile, ours / plain torch.compile | 1 | 2.00 | 2.00 | 2.00 | - | - |" in table

    without = [name for name in everyone if name != suite.SIMPLE_FSDP]
    labels = [label for label, _, _ in suite._ratios(_measured(without))]
    assert labels and not any("SimpleFSDP" in label for label in labels)


def test_simple_fsdp_availability_is_a_reason_or_none():
    reason = suite.simple_fsdp_unavailable()
    assert reason is None or isinstance(reason, str) and reason


def _compile_measured(cpu16_reuse: float, warm: float, entries: int) -> dict:
    """compile_goals.measure()'s shape, JSON keys as strings; depth figures are (wall s, CPU s)."""
    depth = {
        compile_goals.DEFAULT: {"4": [30.0, 28.0], "16": [31.0, cpu16_reuse]},
        compile_goals.NO_REUSE: {"4": [35.0, 34.0], "16": [66.0, 65.0]},
        compile_goals.PLAIN: {"4": [33.0, 32.0], "16": [53.0, 52.0]},
    }
    meta = {
        "1b": {"8": {"compile_s": 4.0}, "16": {"compile_s": 6.0}},
        "70b": {"8": {"compile_s": 5.0}, "80": {"compile_s": 11.5}},
    }
    rank = {"first_step_s": warm - 1.0, "import_inductor_s": 1.0, "aot_cache": {"autograd_cache_hit": 1}}
    cold = {"first_step_s": 40.0, "import_inductor_s": 1.0, "aot_cache": {"autograd_cache_miss": 1}}
    loaded = {**cold, "aot_cache": {}}  # one compile per job: the other rank loads the compiling rank's entries
    runs = [[loaded, cold], [rank, rank], [rank, rank]]
    ranks = {"1": 30.0, "4": 36.0, "cores": 2, "layers": 4}
    restart = {"warm_s": 4.0, "artifacts_s": 5.0, "world": 2}
    warm_runs = {"runs": runs, "aot_cache_entries": entries, "world": 2}
    return {"depth": depth, "meta": meta, "ranks": ranks, "restart": restart, "warm": warm_runs}


def test_compile_goal_rows():
    """Each goal's value is the ratio (or seconds) from the measured figures, judged against its limit; the ranks
    share the cache only when one rank's entries serve all of them."""
    rows = {goal: (value, limit) for goal, value, limit, _ in compile_goals.rows(_compile_measured(29.4, 4.5, 1))}
    assert rows["compile, fully_shard defaults: 16 layers / 4 layers <= 1.3"] == (29.4 / 28.0, 1.3)
    assert rows["compile, fully_shard defaults / plain torch.compile at 16 layers <= 0.8"] == (29.4 / 52.0, 0.8)
    assert rows["cold compile, 4 ranks / 1 rank <= 1.15"] == (36.0 / 30.0, 1.15)
    assert rows["restart on an empty cache from the artifacts / warm restart <= 1.3"] == (5.0 / 4.0, 1.3)
    assert rows["compile, 70b shapes, reuse_blocks: 80 layers / 8 layers <= 2"] == (11.5 / 5.0, 2.0)
    assert rows["warm restart of the main job (s) <= 5"] == (4.5, 5.0)
    assert rows["ranks not sharing one set of cache entries (0 = they share)"] == (0.0, 0.0)
    table = "\n".join(compile_goals.table(_compile_measured(29.4, 4.5, 1)))
    assert "| compile, 70b shapes, reuse_blocks: 80 layers / 8 layers <= 2 | 2.30 | no |" in table
    assert "| warm restart of the main job (s) <= 5 | 4.50 | yes |" in table
    unshared = {goal: value for goal, value, _, _ in compile_goals.rows(_compile_measured(29.4, 5.5, 2))}
    assert unshared["ranks not sharing one set of cache entries (0 = they share)"] == 1.0
    assert unshared["warm restart of the main job (s) <= 5"] == 5.5
