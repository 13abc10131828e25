"""torchtitan 0.3.0's models on CPU, for tests that run code nobody here wrote (test-only; torchtitan is not a
dependency of the package). `pip install --no-deps torchtitan==0.3.0` and `pip install spmd_types==0.2.3 einops tyro
safetensors torchdata` bring it; `available()` says why it cannot be used when it cannot."""

from __future__ import annotations

import importlib
import inspect
import sys
import types

import torch
import torch.nn as nn


def available() -> str | None:
    """None when torchtitan's models and its FSDP recipe import here, else the reason they do not (torchtitan 0.3.0
    imports names torch 2.11 lacks, e.g. `torch.distributed.fsdp.DataParallelMeshDims`)."""
    try:
        _import_models()
        importlib.import_module("torchtitan.distributed.fsdp")
    except Exception as error:  # an absent package or one of its dependencies
        return f"torchtitan 0.3.0 with its CPU dependencies is not importable: {error!r}"
    return None


class _NoKernels(types.ModuleType):
    """Stands in for a module of Triton kernels: any name imports, and calling one says why it cannot run."""

    def __getattr__(self, attribute: str):
        if attribute.startswith("__"):
            raise AttributeError(attribute)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{self.__name__}.{attribute}: a Triton kernel, not available in this CPU test setup")

        return unavailable


def _import_models():
    # Triton kernels of expert parallelism, imported by the models package but never called without GPUs.
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    sys.modules.setdefault(name, _NoKernels(name))
    return importlib.import_module("torchtitan.models")


def build(
    family: str = "llama3",
    flavor: str = "debugmodel",
    seed: int = 0,
    layers: int | None = None,
    expert_hidden: int | None = None,
) -> nn.Module:
    """torchtitan's `family` model of `flavor`, initialised by its own `init_states()` from `seed`, with SDPA instead
    of FlexAttention (which has no CPU backward); `layers`: only the first that many of its layers (Qwen3's
    `debugmodel_moe` has 316 M parameters in 8); `expert_hidden`: each MoE expert's hidden size instead of the
    flavor's (its 64 experts of 768 are 302 M of those parameters; the routing, top-k and load-balancing buffers stay
    as they are). Call it as `model(tokens, positions, None)`."""
    _import_models()
    configs = importlib.import_module(f"torchtitan.models.{family}")
    registry = getattr(configs, f"{family}_configs", None) or getattr(configs, f"{family.replace('_', '')}_configs")
    factory = registry[flavor]
    # DeepSeek-V3's flavors also take the MoE's token dispatch: "standard", all-to-all-free on one expert group
    takes_comm = "moe_comm_backend" in inspect.signature(factory).parameters
    config = factory("flex", **({"moe_comm_backend": "standard"} if takes_comm else {}))
    if layers is not None:
        config.layers = config.layers[:layers]
    if expert_hidden is not None:
        for layer in config.layers:
            layer.moe.routed_experts.inner_experts.hidden_dim = expert_hidden
    torch.manual_seed(seed)
    model = config.build()
    model.init_states()
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in model.layers.values():
        layer.attention.inner_attention = ScaledDotProductAttention(None)
    return model


def apply_fsdp(model: nn.Module, mesh, fully_shard) -> None:
    """torchtitan's own `apply_fsdp_to_decoder`, unmodified, with `fully_shard` in place of the name it imports
    (torch's FSDP2, or `fsdp_graph.fsdp2.fully_shard`: the one-import change), fp32."""
    from unittest import mock

    import torchtitan.distributed.fsdp as titan_fsdp

    with mock.patch.object(titan_fsdp, "fully_shard", fully_shard):
        titan_fsdp.apply_fsdp_to_decoder(model, mesh, torch.float32, torch.float32, pp_enabled=False)


def ep_dims(world: int, ep: int, replicate: int = 1):
    """torchtitan's `ParallelDims` for FSDP x EP on `world` CPU ranks (ep x efsdp, efsdp = world / ep; `replicate`:
    HSDP, dp_replicate x dp_shard, efsdp = dp_shard / ep), with its
    meshes built. Two settings its trainer makes from its config: the "partial_dtensor" SPMD backend (trainer.py
    calls `set_spmd_backend(config.parallelism.spmd_backend)`; DTensor for tp and ep only, as FSDP2 needs), and the
    meshes' device type, which torchtitan takes from `tools.utils.device_type` ("cuda" on a machine without GPUs)."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.distributed import ParallelDims

    _import_models()
    dist_utils.set_spmd_backend("partial_dtensor")
    parallel_dims.device_type = "cpu"
    dims = ParallelDims(
        dp_replicate=replicate,
        dp_shard=world // replicate,
        cp=1,
        tp=1,
        pp=1,
        ep=ep,
        world_size=world,
        spmd_backend="partial_dtensor",
    )
    dims.build_mesh()
    return dims


def build_ep(
    flavor: str,
    dims,
    layers: int | None = None,
    expert_hidden: int | None = None,
    experts: int | None = None,
    top_k: int | None = None,
    seed: int = 0,
):
    """Qwen3's `flavor` (see `build`) configured for `dims`' expert parallelism as torchtitan's trainer does it:
    `set_qwen3_sharding_config(config, enable_ep=...)`, the one step of `Qwen3Model.Config.update_from_config`
    that concerns EP (that method imports torchtitan.trainer, whose metrics import tensorboard, absent here; its
    other EP step, `update_ep_token_dispatcher_config`, only configures the DeepEP/HybridEP dispatchers).
    `experts` and `top_k`: that many experts, each token routed to `top_k` of them, in layers torchtitan's own
    `_build_qwen3_moe_layers` makes with debugmodel_moe's other sizes (its 64 experts and top 8 otherwise)."""
    _import_models()
    from torchtitan.config import ParallelismConfig
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import qwen3_configs
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    config = qwen3_configs[flavor]("flex")
    if experts is not None:
        import torchtitan.models.qwen3 as qwen3

        first = config.layers[0]
        attention = first.attention
        config.layers = qwen3._build_qwen3_moe_layers(
            n_layers=len(config.layers),
            dim=config.dim,
            n_heads=attention.n_heads,
            n_kv_heads=attention.n_kv_heads,
            head_dim=attention.head_dim,
            moe_hidden_dim=first.moe.routed_experts.inner_experts.hidden_dim,
            num_experts=experts,
            top_k=top_k,
            attn_backend="flex",
            moe_comm_backend="standard",
            rope=attention.rope,
        )
    if layers is not None:
        config.layers = config.layers[:layers]
    if expert_hidden is not None:
        for layer in config.layers:
            layer.moe.routed_experts.inner_experts.hidden_dim = expert_hidden
    set_qwen3_sharding_config(config, enable_sp=ParallelismConfig().enable_sequence_parallel, enable_ep=dims.ep_enabled)
    torch.manual_seed(seed)
    model = config.build()
    model.init_states()
    for layer in model.layers.values():
        layer.attention.inner_attention = ScaledDotProductAttention(None)
    return model


def parallelize_ep(model: nn.Module, dims, fully_shard) -> None:
    """torchtitan's own `parallelize_qwen3`, unmodified (its `model.parallelize(parallel_dims)`: the experts become
    DTensors on "ep", the token dispatcher gets the "ep" mesh; then `apply_fsdp_to_decoder(..., ep_degree,
    edp_mesh=efsdp)`), fp32, with `fully_shard` in place of the name torchtitan's fsdp module imports."""
    from unittest import mock

    import torchtitan.distributed.fsdp as titan_fsdp
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3

    parallelism = ParallelismConfig(
        data_parallel_replicate_degree=dims.dp_replicate,
        data_parallel_shard_degree=dims.dp_shard,
        expert_parallel_degree=dims.ep,
        spmd_backend="partial_dtensor",
    )
    training = TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32")
    with mock.patch.object(titan_fsdp, "fully_shard", fully_shard):
        parallelize_qwen3(
            model,
            parallel_dims=dims,
            training=training,
            parallelism=parallelism,
            compile_config=CompileConfig(),
            ac_config=None,
            dump_folder="",
        )
