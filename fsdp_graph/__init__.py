"""fsdp_graph: Fully Sharded Data Parallel training as a compiler pass."""

from fsdp_graph.api import fully_shard
from fsdp_graph.backend import FSDPBackend, GraphReport, fsdp_backend, make_backend
from fsdp_graph.checkpoint_io import load_checkpoint, save_checkpoint
from fsdp_graph.clip import clip_grad_norm_
from fsdp_graph.config import CPUOffload, MixedPrecision, ShardingStrategy
from fsdp_graph.controls import FSDPModule, UnshardHandle, register_fsdp_forward_method
from fsdp_graph.explain import ExplainReport, explain
from fsdp_graph.full_params import summon_full_params
from fsdp_graph.optim import optimizer_in_backward
from fsdp_graph.optim_state import load_optim_state_dict, optim_state_dict
from fsdp_graph.state_dict import full_state_dict
from fsdp_graph.sync import no_sync, set_requires_gradient_sync
from fsdp_graph.wrap import ModuleWrapPolicy, size_based_wrap_policy

__all__ = [
    "CPUOffload",
    "ExplainReport",
    "FSDPBackend",
    "FSDPModule",
    "GraphReport",
    "MixedPrecision",
    "ModuleWrapPolicy",
    "ShardingStrategy",
    "UnshardHandle",
    "clip_grad_norm_",
    "explain",
    "fsdp_backend",
    "full_state_dict",
    "fully_shard",
    "make_backend",
    "no_sync",
    "load_checkpoint",
    "load_optim_state_dict",
    "optim_state_dict",
    "save_checkpoint",
    "set_requires_gradient_sync",
    "optimizer_in_backward",
    "register_fsdp_forward_method",
    "summon_full_params",
    "size_based_wrap_policy",
]
