"""plan(): candidate layouts, how a layout is costed from its traced profile, a small search on the fake process
group (what fits, what does not and why, the ranking), full activation checkpointing on meta, the optimizer model,
and the main job's --plan / --layout auto wiring."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import fsdp_graph
from fsdp_graph.planning.layouts import (
    Layout,
    TrainingLoop,
    comm_lower_bound,
    evaluate,
    memory_lower_bound,
    model_flops_per_token,
    throughput_bound,
)
from fsdp_graph.planning.optimizer import optimizer_model
from fsdp_graph.planning.planner import PlanResult, candidate_layouts
from fsdp_graph.planning.profiles import Profile, ProfileKey, Profiles
from fsdp_graph.train import job
from fsdp_graph.train import layout as job_layout
from fsdp_graph.train.llama import Llama, LlamaConfig, preset
from passes.hardware import GIB, GPUS, Hardware

TINY = LlamaConfig(vocab=256, dim=64, layers=2, heads=2, kv_heads=2, hidden=128, seq=32)


def test_candidate_layouts_divide_world_and_batch():
    cfg = preset("8b")
    layouts = candidate_layouts(cfg, 16, 32, GPUS["h100"])
    assert layouts and all(lay.world == 16 for lay in layouts)
    for lay in layouts:
        assert lay.dp_shard * lay.dp_replicate * lay.micro_batch * lay.microbatches == 32
        assert lay.tp <= 8 and cfg.kv_heads % lay.tp == 0
        assert lay.reshard_after_forward or (lay.tp == 1 and lay.pp == 1)
    assert {lay.dp_replicate for lay in layouts if lay.tp == 1 and lay.pp == 1} == {1, 2}  # HSDP: 8 per node x 2
    runnable = candidate_layouts(cfg, 16, 32, GPUS["h100"], job=True)
    assert all(not (lay.tp > 1 and lay.pp > 1) and (lay.pp > 1 or lay.microbatches == 1) for lay in runnable)
    assert all(lay.checkpoint == "none" for lay in runnable if lay.pp > 1)


def _profile(key: ProfileKey, per_layer: float, base: float) -> Profile:
    """Figures that grow by `per_layer` a block from `base` (seconds and bytes alike), at depths 3 and 4."""

    def at(depth: int) -> dict[str, float]:
        value = base + per_layer * depth
        return {
            "step_time": value * 1e-9,
            "exposed_comm": 0.1 * value * 1e-9,
            "optimizer_time": 1e-3,
            "peak_memory_bytes": value,
            "reserved_bytes": value + 1000,
            "transient_bytes": value / 2,
            "gradient_bytes": 100.0,
            "shard_bytes": 50.0,
            "optimizer_state_bytes": 100.0,
        }

    return Profile(key, (3, 4), {3: at(3), 4: at(4)}, 0.0)


def test_evaluate_accumulation_and_pipeline():
    cfg = dataclasses.replace(TINY, layers=8)
    hw = GPUS["h100"]
    accumulated = Layout(1, 1, 4, 1, "none", 2, 3)
    profile = _profile(accumulated.profile_key(cfg, 32, True), per_layer=1e6, base=5e6)
    e = evaluate(accumulated, profile, cfg, 32, hw, 1e12)
    per_micro = (5e6 + 8e6) * 1e-9 - 1e-3
    assert e.step_time == pytest.approx(3 * per_micro + 1e-3)
    assert e.allocated_bytes == 13e6 + 100  # the earlier micro-batches' gradients
    assert e.reserved_bytes == e.allocated_bytes + 1000
    assert e.tokens_per_s_per_gpu == pytest.approx(4 * 2 * 3 * 32 / e.step_time / 4)
    assert e.breakdown["exposed communication"] == pytest.approx(3 * 0.1 * 13e6 * 1e-9)

    piped = Layout(1, 2, 2, 1, "none", 1, 4)  # two stages of 4 blocks, 4 micro-batches, 1F1B
    e = evaluate(piped, profile, cfg, 32, hw, 1e12)
    stage = (5e6 + 4e6) * 1e-9 - 1e-3
    assert e.breakdown["pipeline"] > stage  # the fill and drain: one more micro-batch time per extra stage
    assert e.step_time == pytest.approx(4 * stage + e.breakdown["pipeline"] + 1e-3)
    assert e.allocated_bytes == 9e6 + (2 - 1) * 9e6 / 2  # a second micro-batch's activations in flight
    tight = evaluate(piped, profile, cfg, 32, hw, usable_bytes=1e6)
    assert not tight.fits and "GiB reserved" in tight.reason


@pytest.mark.parametrize("slack", [(3000.0, 1000.0), (1000.0, 3000.0)])
def test_reserved_adds_the_largest_sampled_allocator_slack_at_any_depth(slack):
    """The allocator's slack over allocated is not extrapolated in depth: a line through 3000 and 1000 bytes at 3
    and 4 blocks would say 0 at 8 blocks (-5000, clamped), through 1000 and 3000 it would say 11000."""
    cfg = dataclasses.replace(TINY, layers=8)
    layout = Layout(1, 1, 4, 1, "none", 2, 1)
    profile = _profile(layout.profile_key(cfg, 32, True), per_layer=1e6, base=5e6)
    for depth, extra in zip((3, 4), slack):
        profile.sampled[depth]["reserved_bytes"] = profile.sampled[depth]["peak_memory_bytes"] + extra
    e = evaluate(layout, profile, cfg, 32, GPUS["h100"], 1e12)
    assert e.allocated_bytes == 13e6
    assert e.reserved_bytes == e.allocated_bytes + 3000.0


def test_training_loop_memory():
    """What the loop around the model keeps, on the synthetic profile (fp32 shards 50 bytes, optimizer state 100,
    gradient shards 100): a bf16 model keeps half of the shards and state and its gradient shards are half as large;
    accumulation without gradient sync keeps every gradient unsharded in fp32 (the shards' bytes times the shard
    group) instead of its shard; held fp32 logits add micro-batch x seq x vocab x 4 bytes. Each is exact."""
    cfg = dataclasses.replace(TINY, layers=8)
    layout = Layout(1, 1, 4, 1, "none", 2, 3)
    profile = _profile(layout.profile_key(cfg, 32, True), per_layer=1e6, base=5e6)

    def allocated(**loop) -> float:
        return evaluate(layout, profile, cfg, 32, GPUS["h100"], 1e12, TrainingLoop(**loop)).allocated_bytes

    peak = 13e6
    assert allocated() == peak + 100  # the gradient shards kept between micro-batches
    assert allocated(bf16_model=True) == peak - (50 + 100) / 2 + 100 / 2
    assert allocated(sync_each_microbatch=False) == peak + 50 * 4
    assert allocated(holds_fp32_logits=True) == peak + 100 + 2 * 32 * cfg.vocab * 4
    kf = TrainingLoop(bf16_model=True, sync_each_microbatch=False)
    e = evaluate(layout, profile, cfg, 32, GPUS["h100"], 1e12, kf)
    assert e.allocated_bytes == peak - 75 + 200 and e.memory_breakdown["model state"] == (50 * 2 + 100) / 2
    one = dataclasses.replace(layout, microbatches=1)  # nothing is accumulated: the sync setting keeps nothing
    assert evaluate(one, profile, cfg, 32, GPUS["h100"], 1e12, kf).allocated_bytes == peak - 75
    assert kf.describe() == "bf16 model, no gradient sync" and TrainingLoop().describe() == ""
    # the search's lower bound stays one: a bf16 model's state is 8 bytes a parameter, not 16
    big = preset("8b")
    fsdp8 = Layout(1, 1, 8, 1, "full", 1, 1)
    drop = memory_lower_bound(big, 2048, fsdp8) - memory_lower_bound(
        big, 2048, fsdp8, loop=TrainingLoop(bf16_model=True)
    )
    assert drop == pytest.approx(8 * big.num_params() / 8)


def test_bounds():
    cfg, hw = preset("8b"), GPUS["h100"]
    none = Layout(1, 1, 8, 1, "none", 4, 1)  # compute-bound: FSDP inside one node
    full = dataclasses.replace(none, checkpoint="full")
    assert throughput_bound(cfg, 2048, full, hw) == pytest.approx(throughput_bound(cfg, 2048, none, hw) * 6 / 8)
    assert memory_lower_bound(cfg, 2048, none) > memory_lower_bound(cfg, 2048, full) > 16 * cfg.num_params() / 8
    kept = dataclasses.replace(none, reshard_after_forward=False)  # every block stays gathered for the backward
    assert memory_lower_bound(cfg, 2048, kept) > memory_lower_bound(cfg, 2048, none) + cfg.num_params()
    # Across 64 nodes with one sequence per rank the collectives bound the step, not the matmuls.
    wide = Layout(1, 1, 512, 1, "full", 1, 1)
    assert comm_lower_bound(cfg, 2048, wide, hw) > model_flops_per_token(cfg, 2048) * 2048 / hw.matmul_rate()


def test_plan_searches_rejects_and_ranks(tmp_path):
    """On a GPU with room for the tiny model's activations only under checkpointing, plain FSDP is reported as not
    fitting, full checkpointing is proposed, and the second plan traces nothing (its profiles are cached)."""
    options = dict(
        world=4, global_batch=16, seq=256, tp=(1,), pp=(1,), checkpoint=("none", "full"), hsdp=False,
        reshard=(True,), micro_batch=(4,), memory_headroom=0, cache_dir=str(tmp_path),
    )  # fmt: skip
    roomy = fsdp_graph.plan(TINY, hardware=GPUS["h100"], **options)
    by_ac = {e.layout.checkpoint: e for e in roomy.ranked}
    assert set(by_ac) == {"none", "full"} and roomy.profiles_traced == 2
    none, full = by_ac["none"], by_ac["full"]
    assert full.allocated_bytes < none.allocated_bytes and full.reserved_bytes <= none.reserved_bytes
    assert none.tokens_per_s_per_gpu > full.tokens_per_s_per_gpu  # no forward recomputed
    assert [e.tokens_per_s_per_gpu for e in roomy.ranked] == sorted(
        (e.tokens_per_s_per_gpu for e in roomy.ranked), reverse=True
    )
    assert roomy.baseline.layout == none.layout and roomy.baseline.fits
    for e in roomy.ranked:  # the bounds the search prunes by hold for what it plans
        assert e.tokens_per_s_per_gpu <= throughput_bound(TINY, 256, e.layout, GPUS["h100"])
        assert e.allocated_bytes >= memory_lower_bound(dataclasses.replace(TINY, seq=256), 256, e.layout)

    between = (full.allocated_bytes + none.allocated_bytes) / 2 + (none.reserved_bytes - none.allocated_bytes)
    small = dataclasses.replace(GPUS["h100"], name="small-gpu", memory_capacity_bytes=int(between))
    tight = fsdp_graph.plan(TINY, hardware=small, **options)
    assert tight.profiles_traced == 0 and tight.profiles_cached == 2
    assert [e.layout.checkpoint for e in tight.ranked] == ["full"]
    assert not tight.baseline.fits and "GiB reserved" in tight.baseline.reason
    assert all(e.reason for e in tight.rejected)
    text = tight.to_text()
    for needle in ("FSDP alone", "does not fit", "tokens/s/GPU", "best: FSDP 4, AC full", "0 profiles traced"):
        assert needle in text, text
    # the loop's habits reach every evaluation of the search (from the cache: nothing traced)
    held = fsdp_graph.plan(TINY, hardware=GPUS["h100"], training_loop=TrainingLoop(holds_fp32_logits=True), **options)
    logits = 4 * 256 * TINY.vocab * 4  # micro-batch x seq x vocab, fp32
    assert held.profiles_traced == 0 and held.baseline.allocated_bytes == none.allocated_bytes + logits
    assert {e.layout: e.allocated_bytes for e in held.ranked} == {
        e.layout: e.allocated_bytes + logits for e in roomy.ranked
    }


def test_full_checkpointing_plans_on_meta(fake_pg):
    """The partitioner recomputes attention through run_and_save_rng_state, which raised "Backend not supported for
    meta" before explain() let it run on meta tensors. Full checkpointing keeps less and recomputes the forward."""
    reports = {}
    for mode in ("none", "full"):
        with torch.device("meta"):
            model = Llama(dataclasses.replace(TINY, checkpoint=mode))
        fsdp_graph.fully_shard(model, device="meta", param_init_fn=model.init_module, reuse_blocks=False)
        idx = torch.zeros(4, 32, dtype=torch.long, device="meta")

        def loss(logits, idx=idx):
            return -logits.log_softmax(-1).gather(-1, idx.unsqueeze(-1)).mean()

        reports[mode] = fsdp_graph.explain(model, idx, loss_fn=loss, hardware="h100", optimizer="adamw-fused")
        if mode == "none":
            elements = sum(reports[mode].extras.param_elements)  # each parameter's share of its unit's shard
            shard = sum(state.layout.shard_numel for state in fsdp_graph.runtime.unit.flat_params(model))
            assert shard <= elements <= shard + len(list(model.parameters()))
    none, full = reports["none"], reports["full"]
    assert full.memory.peak_bytes < none.memory.peak_bytes
    flops = [r.forward.flops + r.backward.flops for r in (none, full)]
    assert flops[1] > flops[0]
    # The optimizer: two fp32 moments per element of the rank's shards, beside the peak.
    assert none.optimizer_state_bytes == 8 * sum(none.extras.param_elements)
    assert none.peak_memory_bytes >= none.memory.total_peak_bytes + none.optimizer_state_bytes
    assert none.reserved_bytes >= none.peak_memory_bytes
    assert none.step_time == pytest.approx(none.backward.end + none.optimizer_time)
    text = none.to_text()
    assert "optimizer: adamw (fused)" in text and "reserved by the caching allocator" in text


def test_optimizer_models():
    hw = Hardware("round", 1e12, 1e12, 1e9, 0.0, kernel_overhead_s=1e-6)
    fused = optimizer_model("adamw-fused")
    foreach = optimizer_model("adamw")
    assert (fused.states, fused.step_bytes, fused.temporaries) == (2, 28, 0)
    assert (foreach.step_bytes, foreach.temporaries, foreach.implementation) == (84, 1, "foreach")
    assert fused.seconds([1000, 3000], hw) == pytest.approx(28 * 4000 / 1e12 + 1e-6)
    assert foreach.seconds([1000, 3000], hw) == pytest.approx(84 * 4000 / 1e12 + 8 * 1e-6)
    loop = optimizer_model("sgd-momentum-for-loop", clip=True)
    assert loop.seconds([1000, 3000], hw) == pytest.approx((32 + 12) * 4000 / 1e12 + (3 + 2) * 2 * 1e-6)
    param = torch.nn.Parameter(torch.empty(4, device="meta"))
    assert optimizer_model(torch.optim.AdamW([param], fused=True)) == fused
    assert optimizer_model(torch.optim.SGD([param], lr=0.1)).states == 0
    with pytest.raises(ValueError, match="adamw"):
        optimizer_model("lion")


def _canned_plan(calls: list) -> object:
    best = Layout(2, 1, 2, 1, "full", 4, 1)

    def plan(cfg, **kwargs):
        calls.append((cfg, kwargs))
        result = PlanResult(cfg, kwargs["world"], GPUS["h100"], kwargs["global_batch"], kwargs["seq"], 70 * GIB)
        result.ranked.append(
            evaluate(best, _profile(best.profile_key(cfg, 32, True), 1e6, 5e6), cfg, 32, GPUS["h100"], 1e12)
        )
        return result

    return plan


def test_job_plan_prints_and_exits(monkeypatch, capsys):
    calls: list = []
    monkeypatch.setattr(fsdp_graph, "plan", _canned_plan(calls))
    monkeypatch.setattr(job, "spawn", lambda *a, **k: pytest.fail("--plan must not train"))
    assert job.main(["--plan", "--preset", "tiny", "--world", "4", "--batch", "2", "--hardware", "h200"]) is None
    cfg, kwargs = calls[0]
    assert cfg.layers == preset("tiny").layers and kwargs["world"] == 4 and kwargs["global_batch"] == 8
    assert kwargs["hardware"] == "h200" and kwargs["job"] is True
    assert "fsdp_graph.plan" in capsys.readouterr().out


def test_job_layout_auto_trains_the_best_layout(monkeypatch):
    monkeypatch.setattr(fsdp_graph, "plan", _canned_plan([]))
    started = []
    monkeypatch.setattr(job, "spawn", lambda fn, world, args, **k: started.append(args[0]) or [None])
    job.main(["--layout", "auto", "--preset", "tiny", "--world", "4", "--batch", "2"])
    args = started[0]
    assert (args.tp, args.pp, args.batch, args.ac, args.strategy) == (2, 1, 4, "full", "FULL_SHARD")
    assert args.reuse_blocks is False  # checkpointed blocks are traced one by one
    hsdp = Layout(1, 1, 2, 2, "none", 2, 1, compression="int8")
    job_layout.apply_layout(args, hsdp)
    assert (args.tp, args.strategy, args.batch) == (1, "HYBRID_SHARD", 2) and args.compress is not None


def test_one_plan_profile_and_its_depth_check():
    """A profile is one plan at 4 blocks plus what its middle block adds; `extend` plans 5 and 6 blocks, checks the
    three are on one line and keeps that line. The one-plan line's communication is exact, its step and memory
    close (what the middle block owns at the peak is what another block adds)."""
    cfg = dataclasses.replace(TINY, layers=8, seq=256)
    profiles = Profiles(GPUS["h100"])
    profile = profiles.get(ProfileKey(cfg, 1, 4, 1, "none", 4, 256))
    assert profile.synthetic and profile.samples == (4, 5) and profiles.traced == 1
    predicted = dict(profile.sampled[5])
    assert profiles.extend(profile) and not profile.synthetic and profile.samples == (4, 5, 6)
    assert profile.linear is True
    real = profile.sampled[5]
    for name in ("sent_bytes", "comm_time", "gathers", "reduce_scatters", "shard_bytes", "params"):
        assert predicted[name] == pytest.approx(real[name], rel=1e-9), name
    assert predicted["step_time"] == pytest.approx(real["step_time"], rel=0.05)
    # The partitioner saves a little more in a small model's last blocks than in its middle ones.
    assert predicted["peak_memory_bytes"] == pytest.approx(real["peak_memory_bytes"], rel=0.15)
    assert not profiles.extend(profile)  # checked once


def test_gpu_presets_carry_the_calibrated_efficiency():
    """plan() and explain() use `passes.hardware.GPUS`: each preset's compute_efficiency is the one
    benchmarks/calibration.py fits on its published rows (from the traced figures it keeps; nothing traced here)."""
    from benchmarks import calibration

    cache = json.loads(calibration.CACHE.read_text())
    fitted = calibration.fit(list(calibration.ROWS), cache)
    assert set(fitted) == {gpu for gpu, hw in GPUS.items() if hw.calibration}
    assert calibration.presets_off_the_fit(fitted) == {}
    assert all(
        dict(hw.calibration)["compute_efficiency"] == hw.compute_efficiency for hw in GPUS.values() if hw.calibration
    )
