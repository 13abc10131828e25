"""GPU tests (`pytest -m gpu tests/gpu`): marked `gpu`, collected everywhere, skipped where CUDA is unavailable."""

import pytest
import torch
import torch.distributed as dist


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def nccl_world1():
    """A one-rank NCCL process group on GPU 0 (bound to it, so NCCL initialises eagerly); yields the device."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    try:
        yield device
    finally:
        dist.destroy_process_group()
