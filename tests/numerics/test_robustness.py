"""Issue 34's guarantees through the API, on 2 gloo ranks in one launch: the non-finite guard (eager and compiled),
stop signals every rank agrees on, and what save_checkpoint / load_checkpoint refuse or report. The same guarantees
through the main job are in test_train_job_robust.py."""

import pytest

from fsdp_graph.train.launch import spawn
from tests.workers.robustness import api_cases


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawn(api_cases, 2, (str(tmp_path_factory.mktemp("robust")),))


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_guard_skips_non_finite_steps_leaving_the_optimizer_untouched(results, mode):
    """A NaN gradient on one rank (its loss finite), seen through the clip norm and through the local gradient
    norms, and a NaN loss on the other rank with finite gradients: each step is skipped on both ranks, and the model
    and optimizer end bit for bit where a run that never took those steps ends."""
    for r in results:
        g = r[f"guard_{mode}"]
        assert [apply for apply, _ in g["verdicts"]] == [True, False, False, False, True], g["verdicts"]
        assert "the gradients are non-finite (norm nan; the loss was finite" in g["verdicts"][1][1], g["verdicts"]
        assert "the gradients are non-finite (the loss was finite" in g["verdicts"][2][1], g["verdicts"]
        assert g["verdicts"][3][1] == "the loss is nan", g["verdicts"]
        assert g["skipped"] == [1, 2, 3]
        assert g["param_diff"] == 0.0 and g["optim_diff"] == 0.0, g


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_guard_stops_with_an_error_naming_the_step(results, mode):
    for r in results:
        g = r[f"guard_{mode}"]
        step, message = g["limit"]
        assert step == 11 and message.startswith("step 11: the gradients are non-finite"), message
        assert "2 steps in a row non-finite (steps 10-11), more than the 1 skips allowed; stopped" in message
        step, message = g["stop"]
        assert step == 10 and "stopped (nonfinite='stop')" in message, message
    assert results[0]["guard_eager"]["limit"] == results[1]["guard_eager"]["limit"]  # every rank alike


def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step(results):
    signals = [r["signals"] for r in results]
    assert [s["guard_stop_step"] for s in signals] == [2, 2], signals
    assert [s["guard_saw_signal"] for s in signals] == [None, "SIGUSR1"], signals
    assert [s["store_stop_step"] for s in signals] == [5, 5], signals  # step 3 + lookahead 2
    assert all(s["handler_restored"] for s in signals), signals


def test_save_refuses_non_finite_state_and_failed_saves_say_why(results):
    for r in results:
        c = r["checkpoints"]
        assert c["nonfinite"] is not None and "refusing to write" in c["nonfinite"], c
        assert "1 tensors hold NaN or Inf (model/" in c["nonfinite"], c
        assert not c["nonfinite_tmp_left"] and not c["full_disk_tmp_left"], c
        assert c["full_disk"] is not None and ": no space left on device (" in c["full_disk"], c["full_disk"]
        assert c["full_disk"].endswith("The partial ckpt.tmp was removed; the previous checkpoint is untouched."), c[
            "full_disk"
        ]
        assert "\n" not in c["full_disk"], c["full_disk"]
        assert c["under_a_file"] is not None and ": it is not a directory." in c["under_a_file"], c
        assert c["previous_diff"] == 0.0, c  # the checkpoint before the failed saves loads as it was saved


def test_load_refuses_a_checkpoint_without_its_manifest_unless_foreign(results):
    for rank, r in enumerate(results):
        c = r["checkpoints"]
        assert c["no_manifest"] is not None and "checksums.json: missing" in c["no_manifest"], c
        assert "pass foreign=True" in c["no_manifest"], c
        assert len(c["foreign_warnings"]) == (1 if rank == 0 else 0), c["foreign_warnings"]
        assert c["extra_damaged"] is not None and "notes.txt: its SHA-256 differs" in c["extra_damaged"], c
        assert c["extra_files_listed"] == [".metadata", "compiled/a.bin", "notes.txt"], c
