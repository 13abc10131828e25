"""benchmarks/suite.py's ratio rows: paired within each run, min/median/max over the runs, and a skipped peer's
rows left out (no measurement of the ranks: these are the tables' arithmetic)."""

from benchmarks import suite


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
    table = suite._ratio_table(suite._ratios(_measured(everyone)))
    assert "| step time, ours / FSDP2 eager | 3 | 0.50 | 0.50 | 0.50 | <= 0.85 | yes |" in table
    assert "| cold compile, ours / plain torch.compile | 1 | 2.00 | 2.00 | 2.00 | - | - |" in table

    without = [name for name in everyone if name != suite.SIMPLE_FSDP]
    labels = [label for label, _, _ in suite._ratios(_measured(without))]
    assert labels and not any("SimpleFSDP" in label for label in labels)


def test_simple_fsdp_availability_is_a_reason_or_none():
    reason = suite.simple_fsdp_unavailable()
    assert reason is None or isinstance(reason, str) and reason
