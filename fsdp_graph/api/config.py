"""User-facing configuration: sharding strategies and mixed precision (FSDP1's names and meanings), per-parameter
placements and per-unit options."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard


class ShardingStrategy(enum.Enum):
    """FULL_SHARD: params, grads, optimizer state sharded; the backward re-gathers (ZeRO-3).
    SHARD_GRAD_OP: the forward keeps gathered params for backward; grads and optimizer state sharded (ZeRO-2).
    NO_SHARD: nothing sharded; gradients all-reduced (DDP semantics on flat parameters).
    HYBRID_SHARD: FULL_SHARD within the shard dim of a 2-D mesh (replicate, shard), replicated across it.
    _HYBRID_SHARD_ZERO2: HYBRID_SHARD without resharding after forward."""

    FULL_SHARD = "full_shard"
    SHARD_GRAD_OP = "shard_grad_op"
    NO_SHARD = "no_shard"
    HYBRID_SHARD = "hybrid_shard"
    _HYBRID_SHARD_ZERO2 = "hybrid_shard_zero2"

    @property
    def is_hybrid(self) -> bool:
        return self in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)

    @property
    def default_reshard_after_forward(self) -> bool:
        # NO_SHARD "re-gathers" nothing: recomputing its no-op gather keeps a copy of the params out of memory.
        return self not in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2)


@dataclass(frozen=True)
class CPUOffload:
    """FSDP1's CPU offload. `offload_params=True`: flat shards, their gradients and so the optimizer state live
    in CPU memory (pinned when CUDA is available); each gather first copies the shard to the compute device
    (`fully_shard(device=...)`, default: the current CUDA device, else cpu), and each reduced gradient shard
    is copied back. The optimizer steps on the CPU."""

    offload_params: bool = False


@dataclass(frozen=True)
class MixedPrecision:
    """FSDP1's mixed precision. Master shards stay in their dtype (fp32).

    - param_dtype: each shard is cast BEFORE the all-gather (communication and compute in this dtype).
    - reduce_dtype: the dtype gradients are reduced in (None: param_dtype, as FSDP1); stored in the shard's dtype.
    - buffer_dtype: buffers are cast to it once, at fully_shard.
    - cast_forward_inputs: every unit casts its floating-point forward inputs to param_dtype;
      cast_root_forward_inputs: the root does (default True, as FSDP1).
    - keep_low_precision_grads: `.grad` is stored in param_dtype (on fp32 parameters, as FSDP1: upcast them
      before a stock optimizer's step, or use one that accepts mixed dtypes).
    - output_dtype: every unit (each module of a unit of several modules too) casts the floating-point tensors its
      forward returns to it (FSDP2's `MixedPrecisionPolicy.output_dtype`; None: no cast).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    output_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise TypeError(f"MixedPrecision.{name} must be a floating-point torch.dtype, got {value!r}")
        if self.keep_low_precision_grads and self.param_dtype is None:
            raise ValueError("MixedPrecision(keep_low_precision_grads=True) needs a param_dtype to keep them in.")

    @property
    def effective_reduce_dtype(self) -> torch.dtype | None:
        return self.reduce_dtype if self.reduce_dtype is not None else self.param_dtype


@dataclass(frozen=True)
class ParamPlacement:
    """Where `fully_shard(shard_placement_fn=...)` puts one parameter: sharded on `placement`'s dim (a
    `torch.distributed.tensor.Shard`; None: `Shard(0)`) over `mesh` (None: its unit's mesh). The native twin of
    FSDP2's `ShardPlacementResult`: experts on an expert-data-parallel mesh, the dense weights on the FSDP one.
    A `Shard(d)` alone may be returned instead when only the dim changes."""

    placement: Shard | None = None
    mesh: DeviceMesh | None = None


@dataclass(frozen=True)
class UnitOptions:
    """Settings of one unit that differ from its `fully_shard` call's (`fully_shard(unit_options={unit: ...})`,
    FSDP2's per-call options): its parameters' default `mesh`, its `mixed_precision`, its `cpu_offload`. None keeps
    the call's. A unit's flat parameters each carry their own mesh, dtypes and device, so units may differ in all
    three within one model and one graph."""

    mesh: DeviceMesh | None = None
    mixed_precision: MixedPrecision | None = None
    cpu_offload: CPUOffload | None = None


_WEIGHT_SCHEMES = ("int8", "fp8")
_GRAD_SCHEMES = ("int8", "int4", "fp8")


@dataclass(frozen=True)
class Compression:
    """Quantized collectives (ZeRO++'s qwZ and qgZ), a `make_backend(compress=...)` option; off by default.

    - weights: each rank's shard is quantized before every all-gather ("int8", "fp8": float8_e4m3fn; None: off) and
      the gathered parameter restored to the compute dtype; the master shard stays full precision. int8 takes one
      scale per block; fp8 one per row of each parameter with the rows layout (a 1-D parameter: its block on each
      rank), per block with the flat layout, in buckets and under `reshard_after_forward=k` (`explain()` says
      "fp8 per row" where rows apply).
    - grads: each gradient is quantized once ("int8", "int4", "fp8"; None: off), sent by an all-to-all instead of a
      reduce-scatter, and each rank sums what it receives in float32, then casts to the reduce dtype. An all-reduce
      over replicas (HYBRID_SHARD, NO_SHARD) is the same all-to-all of row pieces, then the summed piece is
      quantized again and all-gathered (two roundings).
    - block_size: elements per scale (a multiple of 4); each block's float32 scale travels in the same buffer.
    - units: the unit FQNs to compress ("" is the root; None: every unit). A bucket is compressed when all its
      units are.
    """

    weights: str | None = "int8"
    grads: str | None = "int8"
    block_size: int = 256
    units: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.weights not in (None, *_WEIGHT_SCHEMES):
            raise ValueError(f"Compression.weights must be one of {_WEIGHT_SCHEMES} or None, got {self.weights!r}")
        if self.grads not in (None, *_GRAD_SCHEMES):
            raise ValueError(f"Compression.grads must be one of {_GRAD_SCHEMES} or None, got {self.grads!r}")
        if not isinstance(self.block_size, int) or self.block_size < 4 or self.block_size % 4:
            raise ValueError(f"Compression.block_size must be a positive multiple of 4, got {self.block_size!r}")
        if self.units is not None:
            if isinstance(self.units, str) or not all(isinstance(u, str) for u in self.units):
                raise TypeError(f"Compression.units must be a tuple of unit names, got {self.units!r}")
            object.__setattr__(self, "units", tuple(self.units))

    @staticmethod
    def parse(text: str) -> Compression:
        """From a command line: "int8" (weights and gradients), or comma-separated `weights=int8`, `grads=int4`,
        `block=128` ("none" turns one side off)."""
        if "=" not in text:
            return Compression(text, text)
        fields: dict = {"weights": None, "grads": None}
        for part in text.split(","):
            key, _, value = part.partition("=")
            key = {"block": "block_size"}.get(key.strip(), key.strip())
            if key not in ("weights", "grads", "block_size"):
                raise ValueError(f"--compress: unknown key {key!r} in {text!r}; use weights=, grads=, block=")
            value = value.strip()
            fields[key] = int(value) if key == "block_size" else (None if value == "none" else value)
        return Compression(**fields)
