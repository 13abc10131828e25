"""Issue 12: eager FULL_SHARD's saved-tensor hooks keep the user's own (e.g. save_on_cpu) for everything else."""

import torch

import fsdp_graph
from tests.graphs.capture import TwoBlock


def test_enclosing_saved_tensor_hooks_still_see_activations(fake_pg):
    model = fsdp_graph.fully_shard(TwoBlock())
    packed, unpacked = [], []

    def pack(tensor):
        packed.append(tensor.shape)
        return tensor

    def unpack(tensor):
        unpacked.append(tensor.shape)
        return tensor

    x = torch.randn(3, 4, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        model(x).sum().backward()
    assert packed and sorted(packed) == sorted(unpacked)
    # gathered parameter views are ours (re-gathered in backward); only activations (batch of 3) reach the user's
    assert all(shape[0] == 3 for shape in packed), packed
    assert x.grad is not None and x.grad.shape == x.shape
