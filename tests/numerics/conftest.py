import pytest

from fsdp_graph.train import job as train
from tests.workers.train_job import FAST


@pytest.fixture(scope="session")
def plain_job(tmp_path_factory) -> dict:
    """The main job on 2 ranks without --tp or --pp (block reuse by default), 6 steps, uninterrupted, checkpoints at
    steps 3 and 6 in `plain_job["checkpoint_dir"]` (--keep 2) and the loss plot: what the --tp and --no-reuse-blocks
    jobs and the interrupted and resumed ones are compared with, and the CLI test's straight run (nothing in the job
    depends on --steps but the loop's length, nor on saving, so its first 4 steps are a 4-step run's)."""
    ckpt = tmp_path_factory.mktemp("plain_job") / "ckpt"
    args = [*FAST, "--world", "2", "--steps", "6", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3"]
    return {**train.main([*args, "--keep", "2"]), "checkpoint_dir": ckpt}
