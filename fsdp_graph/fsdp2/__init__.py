"""FSDP2's public API on fsdp_graph's engine: change `from torch.distributed.fsdp import fully_shard` to
`from fsdp_graph.fsdp2 import fully_shard` (docs/migrating-from-fsdp2.md). The policies and `FSDPModule` are
torch's own classes; the sharded model trains eagerly and compiles with `fsdp_graph.fsdp_backend` into one graph."""

from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy

from fsdp_graph.api.controls import UnshardHandle
from fsdp_graph.fsdp2.calls import fully_shard, register_fsdp_forward_method, shard_pending

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "shard_pending",
]
