"""The main job (`python -m fsdp_graph train`): its Llama model's parity with single-process training, the CLI end
to end with checkpoint and resume, and failures on one rank ending every rank with a message naming it."""

import hashlib
import json
import os
import subprocess
import sys
import time

import pytest

from fsdp_graph.train import job as train
from fsdp_graph.train.launch import RankFailedError, spawn
from tests.workers.train_job import FAST, llama_checks


def test_llama_sharded_and_compiled_matches_single_process():
    for result in spawn(llama_checks, 2):
        for name in ("tied_full_shard", "untied_shard_grad_op"):
            r = result[name]
            assert r["loss_drop"] > 0.1 and r["param_change"] > 1e-2, (name, r)  # the comparison is not vacuous
            assert r["loss_diff"] < 1e-5, (name, r)
            assert r["param_diff"] < 1e-5, (name, r)
        # One graph. Tied: 2 blocks + the root (embedding/head weight, norm); untied: embedding and head units too.
        assert result["tied_full_shard"]["units"] == 3 and result["untied_shard_grad_op"]["units"] == 5, result
        assert all(result[name]["dynamo_graphs"] == 1 for name in ("tied_full_shard", "untied_shard_grad_op"))
        assert result["tied_full_shard"]["still_tied"]
        # Per unit: a forward gather, a backward re-gather under FULL_SHARD only, one gradient reduction (an
        # all_to_all: gloo has no native reduce-scatter).
        for name, units, bw_gathers in (("tied_full_shard", 3, 3), ("untied_shard_grad_op", 5, 0)):
            (fw_stage, fw), (bw_stage, bw) = result[name]["collectives"]
            assert (fw_stage, bw_stage, fw) == ("fw", "bw", {"all_gather": units}), result[name]["collectives"]
            assert bw.get("all_gather", 0) == bw_gathers, result[name]["collectives"]
            assert bw.get("all_to_all", 0) == units and "reduce_scatter" not in bw, result[name]["collectives"]
        meta = result["meta"]
        assert meta["finite"] and meta["norms_one"], meta
        assert 0.015 < meta["wq_std"] < 0.025 and 0.005 < meta["wo_std"] < 0.0125, meta  # 0.02, 0.02/sqrt(2*2)
        assert meta["rope_diff"] == 0.0 and meta["logits_diff"] < 1e-5, meta


@pytest.mark.oldest_torch
def test_cli_end_to_end_then_resume_continues_exactly(capfd, plain_job):
    """The straight run is `plain_job` (6 steps, checkpoints at 3 and 6, --keep 2, the plot)."""
    straight, ckpt = plain_job, plain_job["checkpoint_dir"]
    assert straight["steps_run"] == 6 and straight["last_loss"] < straight["first_loss"] - 0.5
    assert len(straight["peak_memory_bytes"]) == 2 and min(straight["peak_memory_bytes"]) > 0
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_000003", "step_000006"]
    if _has_matplotlib():
        assert straight["plot"] == str(ckpt / "loss.png")
        assert (ckpt / "loss.png").read_bytes().startswith(b"\x89PNG")

    # Resume from the middle checkpoint: same data order, weights and optimizer state, so steps 4-6 repeat the
    # uninterrupted run's losses, and the loss history carries over.
    capfd.readouterr()
    resumed = train.main([*FAST, "--steps", "6", "--resume", str(ckpt / "step_000003"), "--plot", "none"])
    out = capfd.readouterr().out
    for row in ("loss", "median step time", "tokens/s", "peak memory per rank", "collectives per step", "compile time"):
        assert f"\n{row} " in out, out
    assert "10 all_gather, 5 all_to_all" in out  # 4 blocks + root, FULL_SHARD: forward and backward gathers
    assert resumed["start_step"] == 3 and resumed["steps_run"] == 3
    assert [s for s, _ in resumed["history"]] == [1, 2, 3, 4, 5, 6]
    for (_, a), (_, b) in zip(resumed["history"], straight["history"]):
        assert abs(a - b) < 1e-6, (resumed["history"], straight["history"])
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_000006"]  # --keep 1 (default): the newest only


def test_save_killed_midway_leaves_the_previous_checkpoint_intact_and_publishes_nothing(tmp_path, monkeypatch):
    """Rank 1 is SIGKILLed while saving step 3 (its shard file written, .metadata not): nothing is published as
    step_000003 (rank 0 removes the partial step_000003.tmp if it gets to before the launcher ends it; the next
    start does otherwise) and step_000002 keeps the bytes its manifest recorded. (Resuming past a damaged newest
    checkpoint, a truncated shard among them, repeating the uninterrupted losses: test_train_job_robust.py's
    preemption test; it was a second launch here.)"""
    ckpt = tmp_path / "ckpt"
    args = [*FAST, "--steps", "4", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--keep", "3"]
    monkeypatch.setenv("FSDP_GRAPH_FAIL_AT_STEP", "1:3:save")
    with pytest.raises(RankFailedError) as info:
        train.main([*args, "--plot", "none"])
    assert info.value.rank == 1 and info.value.signal == "SIGKILL", info.value
    names = sorted(p.name for p in ckpt.glob("step_*"))
    assert names in (["step_000001", "step_000002"], ["step_000001", "step_000002", "step_000003.tmp"]), names
    assert not (ckpt / "step_000003.tmp" / ".metadata").exists()
    newest = ckpt / "step_000002"
    for name, entry in json.loads((newest / "checksums.json").read_text())["files"].items():
        assert hashlib.sha256((newest / name).read_bytes()).hexdigest() == entry["sha256"], name


def test_pipeline_parallel_job_trains_and_resumes_exactly(tmp_path, capfd):
    """--pp 2 on 4 ranks: two stages, each sharded over its dp group of 2; checkpoints hold every stage's part."""
    ckpt = tmp_path / "ckpt"
    pp = [*FAST, "--pp", "2", "--world", "4", "--steps", "4", "--plot", "none"]
    straight = train.main([*pp, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--keep", "2"])
    out = capfd.readouterr().out
    assert "4 ranks (gloo, cpu) as pp=2 x dp=2 (1f1b, 2 microbatches)" in out, out
    assert straight["last_loss"] < straight["first_loss"] - 0.5, straight
    # Rank 0 = stage 0 (embedding + 2 blocks: 3 units), 2 microbatches: the gathers per microbatch (3 forward, 2
    # re-gathered in backward), the reductions once per step.
    assert straight["collectives"] == {"all_gather": 10, "all_to_all": 3}, straight["collectives"]
    resumed = train.main([*pp, "--resume", str(ckpt / "step_000002")])
    assert resumed["start_step"] == 2 and resumed["steps_run"] == 2
    for (_, a), (_, b) in zip(resumed["history"], straight["history"]):
        assert abs(a - b) < 1e-6, (resumed["history"], straight["history"])


def test_tensor_parallel_job_matches_the_data_parallel_job(capfd, plain_job):
    """--tp 2 on 4 ranks (dp=2 x tp=2) trains the same model on the same data as the job on 2 ranks without --tp
    (it starts from the same values), so the losses agree. Resuming is the job's own code whatever the mesh
    (test_cli_end_to_end_then_resume_continues_exactly); checkpoints of (dp, tp) DTensors saved and loaded exactly,
    at other dp sizes too: test_tensor_parallel.py's DCP tests."""
    tp = [*FAST, "--tp", "2", "--world", "4", "--steps", "4", "--plot", "none"]
    straight = train.main(tp)
    assert "4 ranks (gloo, cpu) as dp=2 x tp=2" in capfd.readouterr().out
    plain = {"history": plain_job["history"][:4]}
    assert len(straight["history"]) == len(plain["history"]) == 4, (straight["history"], plain["history"])
    assert max(abs(a - b) for (_, a), (_, b) in zip(straight["history"], plain["history"])) < 1e-5, (
        straight["history"],
        plain["history"],
    )
    assert straight["last_loss"] < straight["first_loss"] - 0.5, straight


def test_job_without_block_reuse_trains_like_the_default(plain_job):
    """Block reuse (one compiled block body for every layer, the job's default) changes how the model compiles, not
    what it computes: --no-reuse-blocks gives the same losses, step for step (the default's first 3 of 4)."""
    inlined = train.main([*FAST, "--world", "2", "--steps", "3", "--plot", "none", "--no-reuse-blocks"])
    reused = {"history": plain_job["history"][:3]}
    assert len(inlined["history"]) == len(reused["history"]) == 3, (inlined["history"], reused["history"])
    assert inlined["last_loss"] < inlined["first_loss"], inlined
    assert max(abs(a - b) for (_, a), (_, b) in zip(inlined["history"], reused["history"])) < 1e-6, (
        inlined["history"],
        reused["history"],
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--tp", "3", "--world", "4"], "--tp 3 does not divide the 4 ranks"),
        (["--tp", "2", "--world", "4", "--pp", "2"], "--tp with --pp is not supported yet"),
        (["--tp", "2", "--world", "4", "--strategy", "HYBRID_SHARD"], "--tp runs with FULL_SHARD only"),
        (["--tp", "4", "--world", "4"], "--tp 4 must divide the preset's kv_heads (2)"),
        (["--pp", "3", "--world", "4"], "--pp 3 does not divide the 4 ranks"),
        (["--pp", "2", "--world", "4", "--microbatches", "3"], "--microbatches 3 does not divide --batch 2"),
        (["--pp", "2", "--world", "4", "--strategy", "HYBRID_SHARD"], "--pp with HYBRID_SHARD"),
        (["--reuse-blocks", "--tp", "2", "--world", "4"], "--reuse-blocks runs without --tp"),
    ],
)
def test_parallel_options_are_checked_before_starting(extra, message, capsys):
    with pytest.raises(SystemExit):
        train.parse_args([*FAST, *extra])
    assert message in capsys.readouterr().err


def test_exception_on_one_rank_ends_the_run_naming_it(monkeypatch):
    monkeypatch.setenv("FSDP_GRAPH_FAIL_AT_STEP", "1:1")
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="^rank 1 failed first:\n(.|\n)*injected failure on rank 1") as info:
        train.main([*FAST, "--no-compile", "--steps", "3", "--timeout", "20", "--plot", "none"])
    assert info.value.rank == 1 and info.value.signal is None
    assert time.monotonic() - start < 60


def test_killed_rank_ends_every_rank_with_a_clear_message(tmp_path):
    """SIGKILL leaves no traceback; its peer sees a broken collective. The CLI must blame the killed rank, end the
    survivor, and exit non-zero well within the process group timeout."""
    env = {**os.environ, "FSDP_GRAPH_FAIL_AT_STEP": "1:2:kill"}
    args = [*FAST, "--no-compile", "--steps", "4", "--timeout", "20", "--plot", "none"]
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_graph", "train", *args], env=env, capture_output=True, text=True, timeout=120
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "fsdp-graph train FAILED: rank 1 failed first:\nthe process was killed by SIGKILL" in proc.stderr, (
        proc.stderr
    )
    assert "summary" not in proc.stdout
    assert elapsed < 60, elapsed


def test_stopped_rank_is_named_and_every_rank_ends_within_the_timeout(monkeypatch):
    """A rank stopped with SIGSTOP before its step 2: its peer's collective times out after --timeout, the progress
    each rank recorded in the store names the stopped rank as the one that never reached step 2 (not the peer whose
    wait timed out), and the launcher ends it instead of waiting for it."""
    monkeypatch.setenv("FSDP_GRAPH_FAIL_AT_STEP", "1:1:stop")
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        train.main([*FAST, "--no-compile", "--steps", "3", "--timeout", "5", "--plot", "none"])
    text = str(info.value)
    assert info.value.rank == 1 and info.value.ended == (1,), text
    assert text.startswith("rank 1 failed first:\nit stopped making progress (its process was stopped"), text
    assert "Rank 0 started step 2; rank 1 last started step 1: it never reached it" in text, text
    assert time.monotonic() - start < 45


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True
