import pytest

from fsdp_graph.train import job as train
from tests.workers.train_job import FAST


@pytest.fixture(scope="session")
def plain_job() -> dict:
    """The main job on 2 ranks without --tp or --pp (block reuse by default), 4 steps, uninterrupted: what the --tp
    and --no-reuse-blocks jobs and the interrupted and resumed ones are compared with (nothing in the job depends on
    --steps but the loop's length, so its first 3 steps are a 3-step run's)."""
    return train.main([*FAST, "--world", "2", "--steps", "4", "--plot", "none"])
