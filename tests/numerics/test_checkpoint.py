"""Checkpoints (issue 5): DTensor state dicts through DCP, resharding, FSDP2 interop, exact resume, atomic saves."""

import pytest
import torch

from fsdp_graph.train.launch import spawn
from tests.workers.checkpointing import fsdp2_interop, interrupted_save, reshard_phase, resume_phase


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_resume_in_fresh_processes_is_bit_exact(tmp_path):
    """`load_checkpoint`, and torch's plain DCP recipe with a fresh optimizer (issue 13: its state dict used to have
    no state entries, so DCP loaded nothing into it and the run went on with fresh AdamW moments, silently)."""
    path = str(tmp_path / "ckpt")
    straight = spawn(resume_phase, 2, ("straight", path))[0]
    first = spawn(resume_phase, 2, ("first", path))[0]
    for phase in ("resume", "resume_dcp"):
        resumed = spawn(resume_phase, 2, (phase, path))[0]
        assert first["losses"] + resumed["losses"] == straight["losses"], phase
        assert _max_diff(resumed["params"], straight["params"]) == 0.0, phase
        assert _max_diff(resumed["optim"], straight["optim"]) == 0.0, phase


@pytest.mark.parametrize(
    "saved_with, loads",
    [("flat", ((1, "rows"), (4, "flat"))), ("rows", ((1, "flat"), (3, "rows"), (4, "flat")))],
)
def test_load_at_other_world_sizes(tmp_path, saved_with, loads):
    """Saved at world 2 with one layout, loaded at other world sizes with either (world 3: the GPT's 32-row
    matrices and 16-row position table split into uneven row blocks, 11/11/10 and 6/6/4)."""
    path = str(tmp_path / "ckpt")
    saved = spawn(reshard_phase, 2, ("save", path, saved_with))[0]
    for world, layout in loads:
        for loaded in spawn(reshard_phase, world, ("load", path, layout)):
            assert _max_diff(loaded["params"], saved["params"]) == 0.0, (world, layout)
            assert _max_diff(loaded["optim"], saved["optim"]) == 0.0, (world, layout)
    assert saved["optim"]["blocks.0.fc.weight/exp_avg"].shape == torch.Size([128, 32])  # full shapes, not shards


@pytest.mark.parametrize("layout", ["flat", "rows"])
def test_checkpoints_interoperate_with_torch_fsdp2(tmp_path, layout):
    assert max(spawn(fsdp2_interop, 2, ("fsdp2_to_ours", str(tmp_path / "a"), layout))) == 0.0
    assert max(spawn(fsdp2_interop, 2, ("ours_to_fsdp2", str(tmp_path / "b"), layout))) == 0.0


def test_interrupted_save_keeps_the_previous_checkpoint_and_damaged_files_are_named(tmp_path):
    """Also: a shard file with flipped bytes (DCP alone loads it silently) fails the manifest's SHA-256, and a
    truncated one in a checkpoint without a manifest (loaded as foreign, as torch's) fails the sizes .metadata
    implies; every rank raises the same `DamagedCheckpointError` naming the file."""
    path = str(tmp_path / "ckpt")
    for r in spawn(interrupted_save, 2, (path,)):
        assert r["raised"] and r["diff_to_first_save"] == 0.0 and r["missing_raises"], r
        damaged = r["damaged"]
        assert damaged["flipped"] == (
            f"load_checkpoint: '{path}' is damaged: __1_0.distcp: its SHA-256 differs from checksums.json's "
            "(bytes changed after the save)"
        ), damaged
        assert damaged["truncated_no_manifest"] is not None, damaged
        assert f"'{path}' is damaged: __1_0.distcp: " in damaged["truncated_no_manifest"], damaged
        assert "bytes (from .metadata) expected" in damaged["truncated_no_manifest"], damaged
