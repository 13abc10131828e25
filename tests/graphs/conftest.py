"""Fixtures shared by the graph tests."""

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank():
    """A one-rank gloo process group for the test (a real group: block reuse's compiled bodies run collectives)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
