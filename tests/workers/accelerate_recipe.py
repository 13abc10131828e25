"""Rank-side: accelerate 1.15.0's FSDP2 path (`Accelerator.prepare` with `FullyShardedDataParallelPlugin(
fsdp_version=2)`, which calls `accelerate.utils.fsdp_utils.fsdp2_prepare_model`) on a Hugging Face Llama, with
`fsdp_graph.fsdp2.fully_shard` in place of torch's, against the same flow with torch's FSDP2.

`fsdp2_prepare_model` imports `fully_shard` from `torch.distributed.fsdp` when it runs; the switch replaces that
module attribute for the duration of `prepare`.

On CPU accelerate never selects FSDP. `Accelerator(cpu=True)` (what `accelerate launch --cpu` sets) makes
`PartialState` choose `DistributedType.MULTI_CPU` on gloo; then `AcceleratorState.__init__` (accelerate/state.py in
1.15.0) sets `self.distributed_type = DistributedType.FSDP` (line 1013), `fsdp_plugin.set_mixed_precision(...)`
(1015) and `self.fsdp_plugin = fsdp_plugin` (1016) only inside `elif self.distributed_type in [MULTI_GPU, MULTI_MLU,
MULTI_SDAA, MULTI_MUSA, MULTI_NPU, MULTI_XPU, MULTI_HPU, MULTI_NEURON]:` (lines 986-995), a list without MULTI_CPU,
so the plugin is dropped and training would be DDP-less plain CPU. `_force_fsdp` makes those three assignments after
`Accelerator(...)`, plus the write-back of line 1037 (`PartialState._shared_state["distributed_type"]`).

One run per configuration: prepare, 3 steps, `get_state_dict` (full), `save_state`, 2 steps, `load_state`, the same
2 steps again (the round trip restores model and optimizer: same losses), SGD with momentum."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

import fsdp_graph
from fsdp_graph import fsdp2

CONFIGS = ("untied", "tied", "bf16", "cpu_ram_efficient_loading")
MODES = ("eager", "compiled")
VOCAB = 64


def available() -> str | None:
    """None when accelerate 1.15.0 and transformers' Llama import here, else the reason they do not."""
    try:
        import accelerate  # noqa: F401
        from transformers import LlamaForCausalLM  # noqa: F401
    except Exception as error:  # an absent package or one of its dependencies
        return f"accelerate 1.15.0 with transformers is not importable: {error!r}"
    return None


def _model(tied: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _force_fsdp(accelerator, plugin, mixed_precision: str) -> None:
    """What `AcceleratorState.__init__` does on accelerators and not on CPU (see the module docstring)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = accelerator.state
    state.distributed_type = DistributedType.FSDP
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)
    state.fsdp_plugin = plugin
    # Every later `AcceleratorState()` copies PartialState's values over its own (state.py:919), so the end of
    # `__init__` writes the choice back there (state.py:1037); so does this.
    PartialState._shared_state["distributed_type"] = state.distributed_type


@contextlib.contextmanager
def _fully_shard_is(shard_with: Callable):
    torch_fully_shard = torch.distributed.fsdp.fully_shard
    torch.distributed.fsdp.fully_shard = shard_with
    try:
        yield
    finally:
        torch.distributed.fsdp.fully_shard = torch_fully_shard


def _run(config: str, shard_with: Callable, compiled: bool, rank: int, world: int, out_dir: str) -> dict:
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # a new Accelerator per run, as a new script would have
    mixed_precision = "bf16" if config == "bf16" else "no"
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        state_dict_type="SHARDED_STATE_DICT", cpu_ram_efficient_loading=config == "cpu_ram_efficient_loading",
    )
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin, mixed_precision=mixed_precision)  # as `launch --cpu`
    _force_fsdp(accelerator, plugin, mixed_precision)
    model = _model(tied=config != "untied")
    if config == "cpu_ram_efficient_loading" and rank != 0:
        with torch.no_grad():  # as from_pretrained leaves them off the main process: rank 0's weights must arrive
            for param in model.parameters():
                param.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    with _fully_shard_is(shard_with):
        model, opt = accelerator.prepare(model, opt)
    run, backend = model, None
    if compiled:
        torch._dynamo.reset()
        backend = fsdp_graph.make_backend(inductor=False)
        run = torch.compile(model, backend=backend, fullgraph=True)
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, VOCAB, (2, 16), generator=gen)] * 5  # one batch per rank: the loss falls

    def step(tokens: torch.Tensor) -> float:
        loss = run(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.item()

    losses = [step(tokens) for tokens in batches[:3]]
    full = {k: v.detach().float().clone() for k, v in accelerator.get_state_dict(model).items()}
    accelerator.save_state(out_dir)
    after_save = [step(tokens) for tokens in batches[3:]]
    accelerator.load_state(out_dir)
    after_load = [step(tokens) for tokens in batches[3:]]
    params = {name: p.to_local().detach().float().clone() for name, p in model.named_parameters()}
    return {
        "losses": losses + after_save, "after_load": after_load, "full": full, "params": params,
        "graphs": None if backend is None else backend.dynamo_graphs,
    }


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest difference of two state dicts with the same keys and shapes (empty: `get_state_dict`'s full state
    dict is rank 0's only)."""
    if list(a) != list(b) or any(a[k].shape != b[k].shape for k in a):
        return float("inf")
    return max([(a[k] - b[k]).abs().max().item() for k in a if a[k].numel()], default=0.0)


def _compare(ref: dict, mine: dict) -> dict[str, float]:
    out = {
        "loss_diff": max(abs(x - y) for x, y in zip(ref["losses"], mine["losses"])),
        "loss_moved": abs(ref["losses"][0] - ref["losses"][2]),
        "round_trip_diff": max(abs(x - y) for x, y in zip(mine["losses"][3:], mine["after_load"])),
        "ref_round_trip_diff": max(abs(x - y) for x, y in zip(ref["losses"][3:], ref["after_load"])),
        "full_state_dict_diff": _max_diff(ref["full"], mine["full"]),
        "full_state_dict_keys": float(len(mine["full"])),
        "param_diff": _max_diff(ref["params"], mine["params"]),
    }
    if mine["graphs"] is not None:
        out["graphs"] = float(mine["graphs"])
    return out


def accelerate_recipe_checks(rank: int, world: int) -> dict[str, dict[str, float | str]]:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))  # accelerate would reset the threads
    holder = [tempfile.mkdtemp(prefix="accelerate_recipe_") if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)  # one checkpoint folder for both ranks
    root = holder[0]
    results: dict[str, dict[str, float | str]] = {}
    try:
        for config in CONFIGS:
            try:
                ref = _run(config, torch.distributed.fsdp.fully_shard, False, rank, world, os.path.join(root, config))
            except Exception:
                results.update({f"{config}[{m}]": {"error": "reference: " + traceback.format_exc(limit=8)} for m in MODES})
                continue
            for mode in MODES:
                name = f"{config}[{mode}]"
                try:
                    mine = _run(config, fsdp2.fully_shard, mode == "compiled", rank, world, os.path.join(root, name))
                    results[name] = _compare(ref, mine)
                except Exception:  # recorded for the test that owns this check
                    results[name] = {"error": traceback.format_exc(limit=8)}
                finally:
                    fsdp2.calls._PENDING.clear()
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    return results
