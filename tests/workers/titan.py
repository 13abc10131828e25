"""torchtitan 0.3.0's models on CPU, for tests that run code nobody here wrote (test-only; torchtitan is not a
dependency of the package). `pip install --no-deps torchtitan==0.3.0` and `pip install spmd_types==0.2.3 einops tyro
safetensors torchdata` bring it; `available()` says why it cannot be used when it cannot."""

from __future__ import annotations

import importlib
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
    registry = getattr(configs, f"{family}_configs")
    config = registry[flavor]("flex")
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
