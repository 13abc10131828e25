"""The GPU cost model's pieces on exact small cases: causal and windowed attention flops, Inductor's fusion groups
and the bytes they move, the caching allocator's reserved bytes, and collectives costed by the links they cross."""

from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.fx as fx
from torch._prims.rng_prims import run_and_save_rng_state

from passes.allocator import replay
from passes.cost import collective_cost, simulate
from passes.fusion import fusion_groups
from passes.hardware import GPUS, Hardware, collective_seconds, span
from passes.kernels import attention_pair_fraction, node_flops
from passes.memory import estimate_memory
from tests.graphs.test_cost import AG, AR, WAIT, Builder

aten = torch.ops.aten
EFFICIENT = aten._scaled_dot_product_efficient_attention.default
EFFICIENT_BACKWARD = aten._scaled_dot_product_efficient_attention_backward.default
B, H, S, D = 2, 4, 16, 8
FULL = 2 * (2 * B * H * S * S * D)  # QK^T and PV over every query-key pair


def _attention(is_causal: bool) -> tuple[fx.Node, fx.Node]:
    b = Builder()
    q = b.input("q", B, H, S, D)
    attn = b("attn", EFFICIENT, q, q, q, None, True, 0.0, is_causal)
    out, lse = b("out", operator.getitem, attn, 0), b("lse", operator.getitem, attn, 1)
    bw = b("bw", EFFICIENT_BACKWARD, out, q, q, q, None, out, lse, _philox(b), _philox(b), 0.0, [True] * 4, is_causal)
    b.done(bw)
    return attn, bw


def _philox(b: Builder) -> fx.Node:
    node = b.graph.placeholder(f"philox{len(b.graph.nodes)}")
    node.meta["val"] = torch.empty((), dtype=torch.int64, device="meta")
    return node


def test_causal_attention_flops():
    full, full_bw = _attention(is_causal=False)
    causal, causal_bw = _attention(is_causal=True)
    assert node_flops(full) == FULL
    pairs = S * (S + 1) // 2  # query i sees keys 0..i
    assert node_flops(causal) == FULL * pairs // (S * S) == 34816
    assert node_flops(causal_bw) == node_flops(full_bw) * pairs // (S * S)
    # A sliding window of 4 keys: queries 0..3 see 1..4 keys, the other 12 see 4.
    assert node_flops(causal, attention_window=4) == FULL * (1 + 2 + 3 + 4 + 12 * 4) // (S * S) == 14848


def test_attention_inside_the_rng_wrapper_counts_as_the_op():
    """Activation checkpointing recomputes random ops through run_and_save_rng_state(op, *args)."""
    b = Builder()
    q = b.input("q", B, H, S, D)
    node = b.graph.create_node("call_function", run_and_save_rng_state, (EFFICIENT, q, q, q, None, True, 0.0, True))
    node.meta["val"] = (torch.empty(16, dtype=torch.uint8, device="meta"), EFFICIENT(*(q.meta["val"],) * 3, None, True))
    assert node_flops(node) == 34816


@pytest.mark.parametrize(("q_len", "k_len", "window"), [(7, 7, None), (5, 9, None), (9, 5, None), (10, 10, 3)])
def test_pair_fraction_counts_pairs(q_len, k_len, window):
    limit = k_len if window is None else window
    pairs = sum(min(i + 1, k_len, limit) for i in range(q_len))
    assert attention_pair_fraction(q_len, k_len, True, window) == pairs / (q_len * k_len)
    assert attention_pair_fraction(q_len, k_len, False) == 1.0


def _chain() -> fx.GraphModule:
    """x -> *2 -> +1 -> mm(w) -> relu -> sum: two fused kernels around the matmul."""
    b = Builder()
    x, w = b.input("x", 10, 100), b.input("w", 100, 20)
    scaled = b("scaled", aten.mul.Tensor, x, 2.0)
    shifted = b("shifted", aten.add.Tensor, scaled, 1.0)
    h = b("h", aten.mm.default, shifted, w)
    r = b("r", aten.relu.default, h)
    s = b("s", aten.sum.default, r)
    return b.done(s)


def test_fused_chain_moves_only_its_inputs_and_outputs():
    gm = _chain()
    plan = fusion_groups(gm)
    kernels = [([n.name for n in k.nodes], k.moved_bytes, k.fused) for k in plan.kernels]
    assert kernels == [
        (["scaled", "shifted"], 4000 + 4000, True),  # reads x, writes the matmul's input; `scaled` stays inside
        (["h"], 4000 + 8000 + 800, False),
        (["r", "s"], 800 + 4, True),  # relu's output never leaves the kernel
    ]
    assert {n.name for n in plan.internal} == {"scaled", "r"}
    # The timeline charges three kernels (the per-kernel overhead once each), not five nodes.
    hw = Hardware("round", 1e9, 1e9, 1e9, 0.0, kernel_overhead_s=1e-6)
    fused, unfused = simulate(gm, hw, 1, fused=True), simulate(gm, hw, 1)
    mm = max(2 * 10 * 100 * 20, 12800) / 1e9  # the matmul is compute-bound at these rates
    assert fused.compute_time == pytest.approx((8000 + 804) / 1e9 + mm + 3e-6)
    assert unfused.compute_time == pytest.approx((8000 + 8000 + 1600 + 804) / 1e9 + mm + 5e-6)
    # Memory: the fused intermediates are never allocated.
    assert estimate_memory(gm, fused=True).peak_bytes < estimate_memory(gm).peak_bytes


def test_rms_norm_is_one_kernel():
    """A reduction, its epilogue on the reduced values, and the pointwise op reading both: Inductor's one kernel."""
    b = Builder()
    x, weight = b.input("x", 64, 32), b.input("weight", 32)
    sq = b("sq", aten.pow.Tensor_Scalar, x, 2)
    mean = b("mean", aten.mean.dim, sq, [-1], True)
    eps = b("eps", aten.add.Tensor, mean, 1e-5)
    inv = b("inv", aten.rsqrt.default, eps)
    normed = b("normed", aten.mul.Tensor, x, inv)
    out = b("out", aten.mul.Tensor, normed, weight)
    plan = fusion_groups(b.done(out))
    assert len(plan.kernels) == 1
    assert plan.kernels[0].moved_bytes == 64 * 32 * 4 + 32 * 4 + 64 * 32 * 4


def test_allocator_reserved_peak_of_a_trace():
    """Worked by hand from CUDACachingAllocator's rules (passes/allocator.py's docstring)."""
    kib, mib = 1024, 2**20
    events = [
        ("malloc", 1, 600 * kib),  # small pool: a 2 MiB segment, split
        ("malloc", 2, 600 * kib),  # the remainder of that segment
        ("malloc", 3, 3 * mib),  # large pool, under 10 MiB: a 20 MiB segment, split (17 MiB left)
        ("free", 3, 0),  # merges back: 20 MiB free
        ("malloc", 4, 15 * mib),  # best fit in the 20 MiB block, 5 MiB split off
        ("malloc", 5, 12 * mib),  # fits nothing free: a 12 MiB segment
        ("malloc", 6, 4 * mib + 512 * kib),  # takes the whole 5 MiB block (0.5 MiB left is not split off)
        ("free", 4, 0),  # 15 MiB free, its neighbour in use
        ("malloc", 7, 16 * mib),  # fits nothing free: a 16 MiB segment
    ]
    allocator = replay(events)
    assert allocator.peak_reserved == 2 * mib + 20 * mib + 12 * mib + 16 * mib
    assert allocator.peak_allocated == 1200 * kib + 12 * mib + (4 * mib + 512 * kib) + 16 * mib
    # Expandable segments: the large pool grows by 20 MiB pages at its end (the free 5 MiB tail first, then the
    # 8.5 MiB left at the end after the 12 MiB and 4.5 MiB requests).
    assert replay(events, expandable_segments=True).peak_reserved == 2 * mib + 3 * 20 * mib


def test_collectives_by_the_links_they_cross():
    hw = Hardware("two-level", 1e12, 1e12, 100e9, 1e-6, ranks_per_node=8, inter_bytes_per_s=10e9, inter_latency_s=5e-6)
    p = 8e9
    # Inside a node: a ring over NVLink.
    assert collective_seconds("all_gather", p, 8, hw) == pytest.approx(7e-6 + 7 / 8 * p / 100e9)
    # One rank per node (an HSDP replica group): every step on the network.
    assert collective_seconds("all_reduce", p, 4, hw, nodes=4, per_node=1) == pytest.approx(
        2 * (3 * 5e-6 + 3 / 4 * p / 10e9)
    )
    # 4 nodes x 8: NVLink moves 7/8 of the payload, each NIC 3/4 of its 1/8 share; the slower phase counts.
    intra, inter = 7e-6 + 7 / 8 * p / 100e9, 3 * 5e-6 + 3 / 4 * (p / 8) / 10e9
    assert collective_seconds("reduce_scatter", p, 32, hw, nodes=4, per_node=8) == pytest.approx(max(intra, inter))
    assert span((0, 8, 16, 24), 8) == (4, 1) and span(tuple(range(16)), 8) == (2, 8) and span((3, 4), None) == (1, 2)

    b = Builder()
    flat = b.input("flat", 1000)
    gathered = b("gathered", AG, flat, 4, "shard")
    reduced = b("reduced", AR, gathered, "sum", "replica")
    b.done(reduced)
    ranks = {"shard": (0, 1, 2, 3), "replica": (0, 8, 16, 24)}
    _, payload, seconds = collective_cost(gathered, hw, 32, {"shard": 4}, ranks)
    assert seconds == pytest.approx(collective_seconds("all_gather", payload, 4, hw))
    _, payload, seconds = collective_cost(reduced, hw, 32, {"replica": 4}, ranks)
    assert seconds == pytest.approx(collective_seconds("all_reduce", payload, 4, hw, nodes=4, per_node=1))


def test_collectives_on_other_links_overlap_and_on_one_link_queue():
    """`simulate` runs each link's collectives one after another and the links beside each other (NCCL: a stream
    per process group): a gather inside a node and an all-reduce across nodes, both waited at once, take the longer
    of the two; two gathers inside one node, their sum; without `ranks_per_node` every group shares one link."""
    hw = Hardware("two-level", 1e12, 1e12, 100e9, 1e-6, ranks_per_node=8, inter_bytes_per_s=10e9, inter_latency_s=5e-6)
    ranks = {"shard": (0, 1, 2, 3), "shard_b": (4, 5, 6, 7), "replica": (0, 8, 16, 24)}
    sizes = {"shard": 4, "shard_b": 4, "replica": 4}

    def both_waited(first_group: str, second_group: str) -> tuple[float, float, float]:
        b = Builder()
        flat, other = b.input("flat", 250_000), b.input("other", 1_000_000)
        first = b("first", AG, flat, 4, first_group)
        second = b("second", AR, other, "sum", second_group) if second_group == "replica" else None
        second = second if second is not None else b("second", AG, flat, 4, second_group)
        done = b("done", aten.add.Tensor, b("w1", WAIT, first), b("w2", WAIT, second))
        gm = b.done(done)
        one = collective_cost(first, hw, 32, sizes, ranks)[2]
        two = collective_cost(second, hw, 32, sizes, ranks)[2]
        return simulate(gm, hw, 32, group_sizes=sizes, group_ranks=ranks).exposed_comm, one, two

    exposed, gather, all_reduce = both_waited("shard", "replica")
    assert exposed == pytest.approx(max(gather, all_reduce)) and all_reduce > gather
    exposed, gather, other_gather = both_waited("shard", "shard_b")
    assert exposed == pytest.approx(gather + other_gather)
    flat = Hardware("flat", 1e12, 1e12, 100e9, 1e-6)
    b = Builder()
    x, y = b.input("x", 250_000), b.input("y", 1_000_000)
    first, second = b("first", AG, x, 4, "shard"), b("second", AR, y, "sum", "replica")
    gm = b.done(b("done", aten.add.Tensor, b("w1", WAIT, first), b("w2", WAIT, second)))
    costs = [collective_cost(n, flat, 32, sizes, ranks)[2] for n in (first, second)]
    assert simulate(gm, flat, 32, group_sizes=sizes, group_ranks=ranks).exposed_comm == pytest.approx(sum(costs))


def test_gpu_presets_are_two_level():
    for name, hw in GPUS.items():
        assert hw.ranks_per_node == 8 and hw.inter_bytes_per_s < hw.link_bytes_per_s, name
        assert hw.matmul_rate() < hw.flops_per_s and hw.memory_capacity_bytes > 64 * 2**30, name
        assert math.isfinite(hw.attention_rate()), name
