"""Tensor parallel x FSDP (issue 14) on 4 gloo ranks as (dp=2, tp=2): parity with single-process training."""

import pytest

from fsdp_graph.train.launch import spawn
from tests.workers.tensor_parallel import (
    LLAMA_UNITS,
    hf_llama_tp,
    llama_minimum_bytes,
    tp_fsdp2_interop,
    tp_fsdp_parity,
    tp_fsdp_parity_cases,
)
from tests.workers.tensor_parallel_dcp import tp_dcp_phase


def _diff(a, b) -> float:
    return (a - b).abs().max().item()


# The 4-rank parity variants of `tp_fsdp_parity`, run in ONE launch (module fixture `parity`): name -> its arguments.
PARITY_CASES = {
    # Non-foreach AdamW on the rows layout's DTensor views (foreach SGD on them: the sequence-parallel case).
    "eager-rows-adamw": {"mode": "eager", "optim": "adamw"},
    "aot-flat-sgd": {"mode": "aot", "layout": "flat"},
    # Inductor x TP: the one full-Inductor case of this file.
    "inductor-rows-adamw_foreach": {"mode": "inductor", "optim": "adamw_foreach"},
    "dp_sum": {"mode": "eager", "break_reduce": True},
    # The 2-norm clip (compiled, FULL_SHARD): the composed case below clips too; HSDP's: test_hsdp_x_tp_on_8_ranks.
    "clip-eager-inf": {"mode": "eager", "clip_norm_type": float("inf")},
    "bf16": {"mode": "aot", "mp": True},
    "composed-clip-2": {"mode": "aot", "composed": True, "clip_norm_type": 2.0},
    "sequence-parallel": {"mode": "aot", "optim": "sgd_foreach", "sequence_parallel": True},
}


@pytest.fixture(scope="module")
def parity() -> dict[str, list[dict[str, float]]]:
    """Each case's per-rank results (see PARITY_CASES)."""
    per_rank = spawn(tp_fsdp_parity_cases, 4, (list(PARITY_CASES.values()),))
    return {name: [results[i] for results in per_rank] for i, name in enumerate(PARITY_CASES)}


# ("aot", "rows", "adamw") was a case of its own: compiled rows is every other aot case; non-foreach AdamW on the
# rows views is "eager-rows-adamw"; foreach AdamW compiled is the Inductor case.
@pytest.mark.parametrize("case", ["eager-rows-adamw", "aot-flat-sgd", "inductor-rows-adamw_foreach"])
def test_tp_colwise_rowwise_inside_fsdp_matches_single_process(parity, case):
    layout, mode = PARITY_CASES[case].get("layout", "rows"), PARITY_CASES[case]["mode"]
    for r in parity[case]:
        # 2 blocks x (q, k, v, o, up, down) x (weight, bias) are tp parameters. With rows the optimizer holds them as
        # DTensors on (dp, tp) with their state-dict specs, and the other 12 (inp, norms, head) as DTensors on the
        # same mesh replicated over tp: local tensors inside the flat shards, full tensors equal to the reference's;
        # with flat all 36 as plain 1-D slices (no DTensor placement describes them).
        assert r["tp_params"] == 24.0 and r["dtensor_views"] == (36.0 if layout == "rows" else 0.0), r
        assert r["one_mesh"] == (1.0 if layout == "rows" else 0.0), r
        assert r["foreach_by_default"] == 1.0, r  # the views (DTensors or slices) take torch's foreach kernels
        assert r["aliased"] == 1.0 and r["view_specs"] == 1.0 and r["full_diff"] < 1e-6, r
        assert r["max_diff"] < 1e-6, r
        # Their gradients: DTensors alike (full tensor = the reference's gradient), accumulated in place, zeroed.
        assert r["grad_specs"] == 1.0 and r["grad_full_diff"] < 1e-6, r
        assert r["grad_accumulated"] == 1.0 and r["grads_zeroed"] == 1.0, r
        # State dicts: DTensors on (dp, tp) (_StridedShard for Colwise weights), full, and both loaded back; the
        # optimizer's (momentum buffers, AdamW's moments: DTensors like their parameters) saved and loaded.
        assert r["sd_placements"] == 1.0 and r["osd_state_types"] == 1.0, r
        state_dicts = ("sd_diff", "full_sd_diff", "load_full_diff", "load_sharded_diff", "osd_diff", "load_osd_diff")
        assert max(r[k] for k in state_dicts) < 1e-6, r
        if mode != "eager":
            assert r["graphs"] == 1.0 and r["checked_graphs"] == 1.0, r  # and the checks' forwards: no recompile
    if mode == "inductor":  # the tp and dp groups under aliases: one compile per tp coordinate, the other rank loads
        assert sorted(r["shared_compiled"] for r in parity[case]) == [0.0, 0.0, 1.0, 1.0], parity[case]
        assert sorted(r["shared_loaded"] for r in parity[case]) == [0.0, 0.0, 1.0, 1.0], parity[case]


def test_tp_parity_fails_without_the_dp_mean(parity):
    """The parity check can fail: the dp gradients summed instead of averaged (divide factor 1) must show."""
    assert all(r["max_diff"] > 1e-3 for r in parity["dp_sum"]), parity["dp_sum"]


@pytest.mark.parametrize("case", ["composed-clip-2", "clip-eager-inf"])
def test_clip_grad_norm_over_dp_and_tp_matches_torch(parity, case):
    """The norm counts a tp-sharded parameter's pieces once each (summed over tp) and a replicated one once (not tp
    times), as torch's clip on the unsharded model; the clipped training keeps parity. (The 2-norm runs compiled,
    after no_sync microbatches: test_tp_with_no_sync_activation_checkpointing_and_bucketing's case.)"""
    for r in parity[case]:
        assert r["min_norm"] > 0.05, r  # every step clipped
        assert r["norm_diff"] < 1e-6 and r["max_diff"] < 1e-6, r


def test_tp_with_bf16_mixed_precision(parity):
    """MixedPrecision(param_dtype=bf16, reduce_dtype=fp32): the shards are cast before the dp gather, the tp pieces
    enter DTensor as bf16, and the tp all-reduces run in bf16. The reference computes with bf16 copies of its fp32
    parameters; summation orders differ (tp partial sums), hence the bf16 tolerance of the other parity tests
    (measured 1.1e-3 on parameters, 5.9e-3 on momentum buffers)."""
    for r in parity["bf16"]:
        assert r["graphs"] == 1.0 and r["sd_placements"] == 1.0, r
        assert r["max_diff"] < 2e-3 and r["osd_diff"] < 1e-2, r


def test_hsdp_x_tp_on_8_ranks():
    """HYBRID_SHARD over (replicate=2, shard=2) with the plan on tp=2, compiled: parity on the 4-way data-parallel
    batch, one graph, the clipped norm equal to torch's, state dicts on the 3-D mesh (Replicate first)."""
    results = spawn(tp_fsdp_parity, 8, ("aot", False, 2.0, "rows", False, True))
    for r in results:
        assert r["graphs"] == 1.0 and r["sd_placements"] == 1.0 and r["min_norm"] > 0.05, r
        state_dicts = ("sd_diff", "full_sd_diff", "load_full_diff", "load_sharded_diff", "osd_diff", "load_osd_diff")
        assert max(r[k] for k in ("max_diff", "norm_diff", *state_dicts)) < 1e-6, r


@pytest.mark.parametrize("direction", ["fsdp2_to_ours", "ours_to_fsdp2"])
def test_dcp_checkpoints_interoperate_with_torch_fsdp2_and_tp(tmp_path, direction):
    """Our (dp, tp) state dict has FSDP2 + TP's placements (_StridedShard for Colwise), so plain DCP moves a
    checkpoint either way, exactly."""
    for r in spawn(tp_fsdp2_interop, 4, (direction, str(tmp_path / "ckpt"))):
        assert r["before_diff"] > 0.1 and r["max_diff"] == 0.0 and r["same_placements"] == 1.0, r


def test_hf_llama_tp_x_fsdp_parity_and_bytes_per_mesh_dimension():
    """transformers' LlamaForCausalLM (tiny config, random init) with q/k/v/gate/up Colwise and o/down Rowwise by
    hand, fully_shard over dp, compiled fullgraph with eager kernels: 3 SGD-with-momentum steps equal single-process
    training on the global batch, in one Dynamo graph. Then one eager step per plan under `wire_bytes_per_group`:
    each mesh dimension's bytes equal `llama_minimum_bytes`, derived from the shapes: the minimum on dp, and on tp
    with PrepareModuleInput on self_attn and mlp (one input-gradient all-reduce per q/k/v and per gate/up); the
    plain plan all-reduces each Colwise layer's input gradient (5 per block in backward instead of 2)."""
    pytest.importorskip("transformers")
    results = spawn(hf_llama_tp, 4)
    for r in results:
        assert r["tp_params"] == 14.0 and r["graphs"] == 1.0, r  # 2 layers x 7 projections; fullgraph, no recompile
        assert r["max_diff"] < 1e-6 and r["param_change"] > 0.05, r
        assert r["batch_shape"] == (4, 16), r
        for prepared in (False, True):
            sent = r["bytes"][prepared]
            assert sent["units"] == LLAMA_UNITS, sent
            expected = llama_minimum_bytes(prepared, batch=4, seq=16)
            # The dp reduce-scatter runs as an all-to-all on gloo (the same bytes).
            measured = {
                "dp_gather": sent["dp_all_gather"],
                "dp_reduce": sent["dp_all_to_all"],
                "tp": sent["tp_all_reduce"],
            }
            assert measured == pytest.approx(expected), (prepared, sent, expected)
            assert set(sent) == {"units", "dp_all_gather", "dp_all_to_all", "tp_all_reduce"}, sent


def test_tp_with_no_sync_activation_checkpointing_and_bucketing(parity):
    """Compiled, each block under activation checkpointing, units' collectives bucketed, and each step two
    microbatches with the first under no_sync: the same parameters as single-process training, one graph per
    sync mode, the state dicts as without them. Per step (measured 4 gathers, 1 reduction, 30 tp all-reduces;
    unbucketed, one microbatch, no checkpointing: 7, 4 and 12): the dp reduction runs once, bucketed, and not
    under no_sync; the gathers are bucketed; the backward recomputes the checkpointed blocks' tp all-reduces."""
    for r in parity["composed-clip-2"]:  # also clipped (2-norm) after the microbatches: the clip test's asserts
        assert r["max_diff"] < 1e-6 and r["sd_placements"] == 1.0 and r["graphs"] == 2.0, r
        assert r["count_all_to_all"] == 1.0 and r["count_all_gather"] <= 4.0, r
        assert r["count_all_reduce"] > 2 * 12, r


def test_sequence_parallel_inside_fsdp_matches_single_process(parity):
    """torchtitan's sequence-parallel plan (`tp_plan(sequence_parallel=True)`: Rowwise `inp` onto Shard(1), norms
    under SequenceParallel, Colwise from Shard(1), Rowwise back onto Shard(1), the sequence gathered for the head),
    compiled: parity with single-process training on the global batch, one graph. The norms' weights and biases are
    Replicate DTensors whose Partial gradients DTensor all-reduces over tp before our dp reduce-scatter."""
    for r in parity["sequence-parallel"]:
        # inp (Rowwise), 2 blocks x (q, k, v, o, up, down, norm1, norm2) x (weight, bias) are tp parameters; the
        # head's views are DTensors on the same mesh too (replicated over tp), so the foreach optimizer steps one list.
        assert r["tp_params"] == 34.0 and r["dtensor_views"] == 36.0 and r["one_mesh"] == 1.0, r
        assert r["graphs"] == 1.0, r
        assert r["aliased"] == 1.0 and r["view_specs"] == 1.0 and r["grad_full_diff"] < 1e-6, r
        assert r["max_diff"] < 1e-6 and r["norm_max_diff"] < 1e-6, r
        assert r["sd_placements"] == 1.0, r
        state_dicts = ("sd_diff", "full_sd_diff", "load_full_diff", "load_sharded_diff", "osd_diff", "load_osd_diff")
        assert max(r[k] for k in state_dicts) < 1e-6, r


def test_dcp_checkpoint_loads_across_dp_sizes_and_without_tp(tmp_path):
    """Saved with DCP on (dp=2, tp=2) after 2 steps, loaded on (dp=1, tp=2) and by plain FSDP on 2 ranks (DCP
    reshards the (dp, tp) DTensors, _StridedShard included): parameters and momentum buffers exactly the saved
    ones, and a third step on the same global batch gives the parameters the original run's third step gave."""
    path = str(tmp_path / "ckpt")
    saved = spawn(tp_dcp_phase, 4, ("save", path, 2))[0]
    for tp in (2, 1):
        for loaded in spawn(tp_dcp_phase, 2, ("load", path, tp)):
            for key in ("params", "optim"):
                assert set(loaded[key]) == set(saved[key]), tp
                assert max(_diff(loaded[key][k], saved[key][k]) for k in saved[key]) == 0.0, (tp, key)
            assert max(_diff(loaded["after_step"][k], v) for k, v in saved["after_step"].items()) < 1e-6, tp
