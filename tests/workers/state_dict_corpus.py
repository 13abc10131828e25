"""A corpus of modules with state-dict code of their own (issue 24), the way models in the wild write it, and the
rank-side checks of tests/numerics/test_state_dict_hooks.py: with `fully_shard` each module's code must see what it
sees under FSDP2 (DTensors), so state dicts equal the unsharded model's and round trips are exact."""

from __future__ import annotations

import os
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.utils import parametrizations, parametrize

import fsdp_graph

DIM = 12  # uneven row blocks at world 4 for the 10-row matrices (3, 3, 3, 1)


def _replicated(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor made whole on every rank (still a DTensor), as FSDP2-aware hooks do before reshaping dim 0."""
    if isinstance(tensor, DTensor):
        return tensor.redistribute(tensor.device_mesh, [Replicate()] * tensor.device_mesh.ndim)
    return tensor


class InterleavedPair(nn.Module):
    """One fused projection whose rows interleave two outputs in groups of 2 (a fused QKV's layout); checkpoints hold
    the two unfused matrices `first` and `second`: a post-hook splits on save, a pre-hook merges on load."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = nn.Linear(DIM, 2 * 10, bias=False)
        self.register_state_dict_post_hook(self._split)
        self.register_load_state_dict_pre_hook(self._merge)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.fused(x).unflatten(-1, (5, 2, 2)).unbind(-2)
        return (a * b).flatten(-2)[..., :DIM].sum(-1, keepdim=True) + x

    @staticmethod
    def _split(module, state_dict, prefix, local_metadata) -> None:
        fused = _replicated(state_dict.pop(prefix + "fused.weight")).reshape(5, 2, 2, DIM)
        state_dict[prefix + "first"] = fused[:, 0].reshape(10, DIM).contiguous()
        state_dict[prefix + "second"] = fused[:, 1].reshape(10, DIM).contiguous()

    @staticmethod
    def _merge(module, state_dict, prefix, *args) -> None:
        if prefix + "first" not in state_dict:
            return
        first, second = (_replicated(state_dict.pop(prefix + k)).reshape(5, 1, 2, DIM) for k in ("first", "second"))
        state_dict[prefix + "fused.weight"] = torch.cat([first, second], dim=1).reshape(20, DIM)


class LegacyNamedNorm(nn.Module):
    """A norm whose checkpoints keep the legacy names `gamma`/`beta` (Hugging Face's old LayerNorm keys): renamed on
    save, renamed back on load."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(DIM))
        self.bias = nn.Parameter(torch.zeros(DIM))
        self._register_state_dict_hook(self._to_legacy)
        self._register_load_state_dict_pre_hook(self._from_legacy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, (DIM,), self.weight, self.bias)

    @staticmethod
    def _to_legacy(module, state_dict, prefix, local_metadata) -> None:
        for new, old in (("weight", "gamma"), ("bias", "beta")):
            state_dict[prefix + old] = state_dict.pop(prefix + new)

    @staticmethod
    def _from_legacy(state_dict, prefix, *args) -> None:
        for new, old in (("weight", "gamma"), ("bias", "beta")):
            if prefix + old in state_dict:
                state_dict[prefix + new] = state_dict.pop(prefix + old)


class DoubleStored(nn.Linear):
    """Stores its weight as float64 (a dtype cast on save) and casts it back on load."""

    def __init__(self) -> None:
        super().__init__(DIM, 10)
        self.register_state_dict_post_hook(self._widen)
        self.register_load_state_dict_pre_hook(self._narrow)

    @staticmethod
    def _widen(module, state_dict, prefix, local_metadata) -> None:
        state_dict[prefix + "weight"] = state_dict[prefix + "weight"].to(torch.float64)

    @staticmethod
    def _narrow(module, state_dict, prefix, *args) -> None:
        if prefix + "weight" in state_dict:
            state_dict[prefix + "weight"] = state_dict[prefix + "weight"].to(torch.float32)


class TransposedLegacy(nn.Linear):
    """Version 1 of this module stored its weight transposed: `_load_from_state_dict` migrates it, reading the
    parameter's shape (under FSDP2 a DTensor's global shape) to check it."""

    _version = 2

    def __init__(self) -> None:
        super().__init__(10, DIM, bias=False)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        key = prefix + "weight"
        if local_metadata.get("version", self._version) < 2 and key in state_dict:
            legacy = state_dict[key]
            if tuple(legacy.shape) != tuple(reversed(self.weight.shape)):
                raise ValueError(
                    f"{key}: a version-1 weight of shape {tuple(legacy.shape)} for {tuple(self.weight.shape)}"
                )
            state_dict[key] = legacy.t()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)


class Scaled(nn.Module):
    """A parametrization (`torch.nn.utils.parametrize`): the weight used is twice the stored one."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 2 * weight


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pair = InterleavedPair()
        self.norm = LegacyNamedNorm()
        self.down = DoubleStored()
        self.up = TransposedLegacy()
        self.normed = parametrizations.weight_norm(nn.Linear(DIM, DIM))
        self.scaled = nn.Linear(DIM, DIM, bias=False)
        parametrize.register_parametrization(self.scaled, "weight", Scaled())
        self.register_buffer("scale", torch.full((DIM,), 0.5))
        self.register_buffer("cache", torch.arange(DIM, dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.pair(x))
        h = h + self.up(torch.tanh(self.down(h))) * self.scale
        return h + self.scaled(torch.tanh(self.normed(h))) + 0 * self.cache


class Corpus(nn.Module):
    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(seed: int) -> Corpus:
    torch.manual_seed(seed)
    return Corpus()


def _full(state: dict) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


def _diff(a: dict, b: dict) -> float:
    """Max abs difference of two state dicts (inf when keys, shapes or dtypes differ)."""
    if set(a) != set(b) or any(a[k].shape != b[k].shape or a[k].dtype != b[k].dtype for k in a):
        return float("inf")
    # torch.equal first: the expected difference is 0, and the float64 copies of a model's tensors cost seconds
    return max(0.0 if torch.equal(a[k], b[k]) else (a[k].double() - b[k].double()).abs().max().item() for k in a)


def _fsdp2(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    for block in model.blocks:
        torch_fully_shard(block)
    return torch_fully_shard(model)


def check(rank: int, world: int, path: str) -> dict[str, float]:
    """Every figure is a max abs difference that must be 0 (inf: keys, shapes or dtypes differ)."""
    reference_model = build(seed=0)
    reference = _full(reference_model.state_dict())
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference_out = reference_model(x)
    legacy = {**reference}
    for i in range(len(reference_model.blocks)):
        legacy[f"blocks.{i}.up.weight"] = reference[f"blocks.{i}.up.weight"].t().contiguous()
    results = {}
    for layout in ("rows", "flat"):
        model = fsdp_graph.fully_shard(build(seed=0), layout=layout)
        sharded = model.state_dict()
        params = {k for k, _ in build(0).named_parameters()}
        results[f"{layout} sharded entries are DTensors"] = float(
            not all(isinstance(v, DTensor) for k, v in sharded.items() if k in params)
        )
        results[f"{layout} sharded"] = _diff(_full(sharded), reference)
        full = fsdp_graph.full_state_dict(model)
        results[f"{layout} full"] = _diff(full, reference)
        with torch.no_grad():
            results[f"{layout} forward"] = (model(x) - reference_out).abs().max().item()

        ours = os.path.join(path, f"ours_{layout}")
        fsdp_graph.save_checkpoint(ours, model)
        fresh = fsdp_graph.fully_shard(build(seed=7), layout=layout)
        fsdp_graph.load_checkpoint(ours, fresh)
        results[f"{layout} dcp round trip"] = _diff(fsdp_graph.full_state_dict(fresh), reference)
        with torch.no_grad():
            results[f"{layout} forward after load"] = (fresh(x) - reference_out).abs().max().item()

        fresh = fsdp_graph.fully_shard(build(seed=7), layout=layout)
        fresh.load_state_dict(reference)  # full tensors
        results[f"{layout} full load"] = _diff(fsdp_graph.full_state_dict(fresh), reference)
        fresh = fsdp_graph.fully_shard(build(seed=7), layout=layout)
        fresh.load_state_dict(_as_version_1(legacy, fresh.state_dict()._metadata))
        results[f"{layout} legacy override"] = _diff(fsdp_graph.full_state_dict(fresh), reference)

        # torch's FSDP2 on the same model, both ways through DCP.
        theirs = os.path.join(path, f"fsdp2_{layout}")
        fsdp2_model = _fsdp2(build(seed=0))
        dcp.save({"model": fsdp2_model.state_dict()}, checkpoint_id=theirs)
        fresh = fsdp_graph.fully_shard(build(seed=7), layout=layout)
        state = {"model": fresh.state_dict()}
        dcp.load(state, checkpoint_id=theirs)
        fresh.load_state_dict(state["model"])
        results[f"{layout} from fsdp2"] = _diff(fsdp_graph.full_state_dict(fresh), reference)
        fsdp2_fresh = _fsdp2(build(seed=7))
        state = {"model": fsdp2_fresh.state_dict()}
        dcp.load(state, checkpoint_id=ours)
        fsdp2_fresh.load_state_dict(state["model"])
        results[f"{layout} to fsdp2"] = _diff(_full(fsdp2_fresh.state_dict()), reference)
        with torch.no_grad():
            for view in model.parameters():  # a full state dict is a copy: training on must not change it
                (view.to_local() if isinstance(view, DTensor) else view).add_(1.0)
        results[f"{layout} full is a copy"] = _diff(full, reference)
        dist.barrier()
    return results


def _as_version_1(state: dict, metadata: dict) -> OrderedDict:
    """`state` with the module versions of `metadata`, TransposedLegacy's set to 1."""
    result = OrderedDict(state)
    result._metadata = {prefix: dict(meta) for prefix, meta in metadata.items()}
    for prefix, meta in result._metadata.items():
        if prefix.endswith(".up"):
            meta["version"] = 1
    return result


def titan_check(
    rank: int, world: int, path: str, family: str, flavor: str, layers: int, layouts: tuple[str, ...]
) -> dict[str, float]:
    """torchtitan's model (its fused QKV and SwiGLU split/merge on save/load): our state dicts equal the unsharded
    model's, a DCP round trip is exact, and checkpoints move both ways with torchtitan's own FSDP2 setup."""
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    from tests.workers import titan

    reference = _full(titan.build(family, flavor, seed=0, layers=layers).state_dict())
    results = {}
    for layout in layouts:
        model = titan.build(family, flavor, seed=0, layers=layers)
        fsdp_graph.fully_shard(model, wrap=fsdp_graph.ModuleWrapPolicy({type(model.layers["0"])}), layout=layout)
        results[f"{layout} full"] = _diff(fsdp_graph.full_state_dict(model), reference)
        ours = os.path.join(path, f"{family}_{layout}")
        fsdp_graph.save_checkpoint(ours, model)
        fresh = titan.build(family, flavor, seed=7, layers=layers)
        fsdp_graph.fully_shard(fresh, wrap=fsdp_graph.ModuleWrapPolicy({type(fresh.layers["0"])}), layout=layout)
        fsdp_graph.load_checkpoint(ours, fresh)
        results[f"{layout} dcp round trip"] = _diff(fsdp_graph.full_state_dict(fresh), reference)

        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
        theirs_model = titan.build(family, flavor, seed=7, layers=layers)
        apply_fsdp_to_decoder(theirs_model, mesh, torch.float32, torch.float32, pp_enabled=False)
        state = {"model": theirs_model.state_dict()}
        dcp.load(state, checkpoint_id=ours)
        theirs_model.load_state_dict(state["model"])
        results[f"{layout} to fsdp2"] = _diff(_full(theirs_model.state_dict()), reference)
        theirs = os.path.join(path, f"{family}_{layout}_fsdp2")
        dcp.save({"model": theirs_model.state_dict()}, checkpoint_id=theirs)
        fresh = titan.build(family, flavor, seed=7, layers=layers)
        fsdp_graph.fully_shard(fresh, layout=layout)
        state = {"model": fresh.state_dict()}
        dcp.load(state, checkpoint_id=theirs)
        fresh.load_state_dict(state["model"])
        results[f"{layout} from fsdp2"] = _diff(fsdp_graph.full_state_dict(fresh), reference)
        dist.barrier()
    return results
