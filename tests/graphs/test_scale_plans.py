"""benchmarks/scale_plans.py: the ZeRO-3 formula, the activation estimate, the table, and one plan of the tiny
Llama on 8 fake ranks whose per-rank bytes are checked against the model's own sizes."""

from __future__ import annotations

import pytest

from benchmarks import scale_plans
from benchmarks.scale_plans import PlanRow, activation_estimate, format_table, zero3_formula
from fsdp_graph.train.llama import preset

GIB = 2**30


def test_zero3_formula():
    # 8 B parameters on 64 ranks: 2 GB of model state each, plus what is gathered and the activations.
    assert zero3_formula(8_000_000_000, 64, 3.0, 5.0) == 16 * 8_000_000_000 / 64 + 8.0


def test_activation_estimate_counts_layers_and_logits():
    one = activation_estimate(dim=8, kv_dim=4, hidden=16, layers=1, vocab=10, tokens=3, elem=2)
    two = activation_estimate(dim=8, kv_dim=4, hidden=16, layers=2, vocab=10, tokens=3, elem=2)
    per_layer = 3 * (7 * 8 + 2 * 4 + 4 * 16) * 2
    assert two - one == per_layer
    assert one == per_layer + 3 * 10 * (2 + 4 + 4)


def _row(**overrides) -> PlanRow:
    values = dict(
        model="8b",
        world=64,
        dtype="bf16",
        layout="rows",
        params=8 * 2**30,
        param_bytes=2 * GIB,
        grad_bytes=2 * GIB,
        optim_bytes=4 * GIB,
        largest_unit_bytes=GIB,
        activation_bytes=6 * GIB,
        peak_bytes=12 * GIB,
        comm_bytes=48 * GIB,
        step_seconds=1.5,
        hardware="infiniband",
        plan_seconds=42.0,
        plan_cpu_seconds=30.0,
    )
    values.update(overrides)
    return PlanRow(**values)


def test_table_row():
    row = _row()
    assert row.zero3_bytes == 16 * 8 * GIB / 64 + 2 * GIB + 6 * GIB  # 10 GiB
    table = format_table([row, _row(world=8, hardware="nvlink", method="4,5,6")])
    lines = table.strip().splitlines()
    assert len(lines) == 4 and lines[0].startswith("| model | ranks |")
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells == [
        "8b", "64", "bf16", "rows", "2.00", "2.00", "4.00", "1.00", "12.00", "10.00", "1.20", "48.0", "1.50 s (infiniband)",
        "every layer", "42 s (30 s)",
    ]  # fmt: skip
    assert lines[3].split("|")[2].strip() == "8" and lines[3].split("|")[14].strip() == "4,5,6 layers"


def test_hardware_by_world():
    assert [scale_plans.hardware_for(w) for w in (8, 64, 1024)] == ["nvlink", "infiniband", "infiniband"]


def test_tiny_plan_bytes_match_the_model():
    world, seq = 8, 32
    cfg = preset("tiny", seq=seq)
    # The flat layout pads each unit's flat parameter as a whole, the arithmetic below.
    row = scale_plans.plan("tiny", world, "fp32", "flat", batch=1, seq=seq, vocab=cfg.vocab)
    assert row.params == cfg.num_params()
    # Tied tiny Llama: a unit per block, the root holding embedding (= head) and the final norm.
    block = (cfg.num_params() - cfg.vocab * cfg.dim - cfg.dim) // cfg.layers
    units = [block] * cfg.layers + [cfg.vocab * cfg.dim + cfg.dim]
    padded = [-(-n // world) * world for n in units]
    assert row.param_bytes == row.grad_bytes == sum(padded) * 4 // world
    assert row.optim_bytes == 2 * row.param_bytes
    assert row.largest_unit_bytes == max(padded) * 4
    # FULL_SHARD: every unit gathered in forward and again in backward, its gradient reduce-scattered once; a ring
    # sends (N-1)/N of each payload.
    assert row.comm_bytes == pytest.approx(3 * sum(padded) * 4 * (world - 1) / world)
    assert row.peak_bytes > row.param_bytes + row.optim_bytes + max(padded) * 4
    assert row.plan_seconds > 0 and row.step_seconds > 0
    assert row.method == "whole"  # 4 layers: not deeper than explain_by_depth's samples
