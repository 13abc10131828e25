"""fsdp_graph: Fully Sharded Data Parallel training as a compiler pass."""

from fsdp_graph.api.clip import clip_grad_norm_
from fsdp_graph.api.config import (
    Compression,
    CPUOffload,
    MixedPrecision,
    ParamPlacement,
    ShardingStrategy,
    UnitOptions,
)
from fsdp_graph.api.controls import FSDPModule, UnshardHandle, register_fsdp_forward_method
from fsdp_graph.api.full_params import summon_full_params
from fsdp_graph.api.fully_shard import fully_shard
from fsdp_graph.api.guard import NonFiniteError, StepCheck, StepGuard
from fsdp_graph.api.optim import optimizer_in_backward
from fsdp_graph.api.preemption import StopSignal
from fsdp_graph.api.sync import no_sync, set_requires_gradient_sync
from fsdp_graph.api.wrap import ModuleWrapPolicy, size_based_wrap_policy
from fsdp_graph.compiler.backend import FSDPBackend, GraphReport, fsdp_backend, make_backend
from fsdp_graph.planning.depth import DepthPlan, explain_by_depth
from fsdp_graph.planning.explain import ExplainReport, explain
from fsdp_graph.planning.planner import PlanResult, plan
from fsdp_graph.state.checkpoint import (
    DamagedCheckpointError,
    NonFiniteCheckpointError,
    load_checkpoint,
    save_checkpoint,
)
from fsdp_graph.state.directory import CheckpointDirError, CheckpointDirLock, check_checkpoint_dir
from fsdp_graph.state.full import full_state_dict
from fsdp_graph.state.optim import load_optim_state_dict, optim_state_dict
from fsdp_graph.state.save_failure import CheckpointSaveError

__all__ = [
    "CPUOffload",
    "CheckpointDirError",
    "CheckpointDirLock",
    "CheckpointSaveError",
    "Compression",
    "DamagedCheckpointError",
    "DepthPlan",
    "ExplainReport",
    "FSDPBackend",
    "FSDPModule",
    "GraphReport",
    "MixedPrecision",
    "ModuleWrapPolicy",
    "NonFiniteCheckpointError",
    "NonFiniteError",
    "ParamPlacement",
    "PipelineStage",
    "PlanResult",
    "ShardingStrategy",
    "StepCheck",
    "StepGuard",
    "StopSignal",
    "UnitOptions",
    "UnshardHandle",
    "check_checkpoint_dir",
    "clip_grad_norm_",
    "explain",
    "explain_by_depth",
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
    "plan",
    "register_fsdp_forward_method",
    "summon_full_params",
    "size_based_wrap_policy",
]


def __getattr__(name: str):
    # torch.distributed.pipelining takes most of a second to import: only for pipeline-parallel users.
    if name == "PipelineStage":
        from fsdp_graph.api.pipelining import PipelineStage

        return PipelineStage
    raise AttributeError(f"module 'fsdp_graph' has no attribute {name!r}")
