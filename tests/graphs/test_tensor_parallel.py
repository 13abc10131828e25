"""Tensor parallel x FSDP (issue 14) on a fake (dp=2, tp=2) world: DTensor's collectives and ours in one graph."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from expecttest import assert_expected_inline
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp_graph
from fsdp_graph.runtime.unit import flat_params
from tests.workers.tensor_parallel import Block

ROOT = Path(__file__).resolve().parents[2]


def _group_sizes(backend, roles: dict | None = None) -> str:
    """The fingerprint with group names replaced by their role (by rank list): dp (ranks [0, 2]) or tp ([0, 1])."""
    roles = roles or {(0, 2): "dp", (0, 1): "tp"}
    names = {}
    for report in backend.reports:
        for group in report.groups:
            ranks = dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(group))
            names[group] = roles[tuple(ranks)]
    text = "\n".join(f"{r.stage}: {line}" for r in backend.reports for line in r.fingerprint)
    for group, role in names.items():
        text = text.replace(f"group={group},", f"group={role},")
    return text


def test_tp_and_fsdp_collectives_in_one_graph(fake_pg):
    torch._dynamo.reset()
    torch.manual_seed(0)
    mesh, model = _mesh(), Block()
    plan = _block_plan()
    parallelize_module(model, mesh["tp"], plan)
    fsdp_graph.fully_shard(model, mesh["dp"])
    backend = fsdp_graph.make_backend(inductor=False)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    compiled(torch.randn(2, 3, 16, requires_grad=True)).sum().backward()
    assert backend.dynamo_graphs == 1
    # One unit (the block): our gather over dp, the two Rowwise all-reduces over tp in forward; in backward the
    # re-gather, the four Colwise input-gradient all-reduces over tp (q, k, v, up) and our reduce-scatter over dp.
    # 580 = half of the block's 1160 tensor-parallel-local elements.
    assert_expected_inline(
        _group_sizes(backend),
        """\
fw: all_gather_into_tensor(group=dp, group_size=2, 580 x float32 -> 1160 x float32)
fw: all_reduce(group=tp, reduce_op=sum, 96 x float32 -> 96 x float32)
fw: all_reduce(group=tp, reduce_op=sum, 96 x float32 -> 96 x float32)
bw: all_gather_into_tensor(group=dp, group_size=2, 580 x float32 -> 1160 x float32)
bw: all_reduce(group=tp, reduce_op=sum, 96 x float32 -> 96 x float32)
bw: all_reduce(group=tp, reduce_op=sum, 96 x float32 -> 96 x float32)
bw: all_reduce(group=tp, reduce_op=sum, 96 x float32 -> 96 x float32)
bw: all_reduce(group=tp, reduce_op=sum, 96 x float32 -> 96 x float32)
bw: reduce_scatter_tensor(group=dp, reduce_op=sum, group_size=2, 1160 x float32 -> 580 x float32)""",
    )


def _block_plan() -> dict:
    """Megatron's plan for `Block`: q, k, v and up column-wise, o and down row-wise."""
    return {**{n: ColwiseParallel() for n in ("q", "k", "v", "up")}, "o": RowwiseParallel(), "down": RowwiseParallel()}


def _mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def test_error_tp_on_the_fsdp_dimension(fake_pg):
    mesh, model = _mesh(), Block()
    parallelize_module(model, mesh["dp"], {"up": ColwiseParallel()})
    with pytest.raises(ValueError, match=r"parameter 'up.weight' is a DTensor.*the same dimension fully_shard shards"):
        fsdp_graph.fully_shard(model, mesh["dp"])


def test_error_tp_on_an_unrelated_mesh(fake_pg):
    mesh, model = _mesh(), Block()
    other = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    parallelize_module(model, other, {"up": ColwiseParallel()})
    with pytest.raises(ValueError, match=r"'up.weight' .*not a named dimension of the world mesh \('dp', 'tp'\)"):
        fsdp_graph.fully_shard(model, mesh["dp"])


def test_error_tp_without_a_mesh(fake_pg):
    mesh, model = _mesh(), Block()
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel()})
    with pytest.raises(ValueError, match=r"'up.weight' .*fully_shard got no mesh.*world_mesh\[.dp.\]"):
        fsdp_graph.fully_shard(model)


def test_error_partial_parameter(fake_pg):
    from torch.distributed.tensor import DTensor, Partial

    mesh, model = _mesh(), Block()
    model.up.weight = torch.nn.Parameter(DTensor.from_local(torch.randn(32, 16), mesh["tp"], [Partial()]))
    with pytest.raises(ValueError, match=r"'up.weight' .*only Shard\(d\) and Replicate\(\) parameters"):
        fsdp_graph.fully_shard(model, mesh["dp"])


def test_error_uneven_tp_shards(fake_pg):
    mesh, model = _mesh(), torch.nn.Sequential(torch.nn.Linear(4, 5))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
    with pytest.raises(ValueError, match=r"'0.weight' .*dim 0 \(5\) does not divide evenly over the 2"):
        fsdp_graph.fully_shard(model, mesh["dp"])


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_meta_device_tp_parameters_materialise_as_if_materialised_first(fake_world_8, sequence_parallel):
    """fully_shard initialises a meta-device DTensor parameter whole (reset_parameters on the global shape: the
    random numbers the model built for real draws, the same on every rank) and keeps this rank's tp piece, then its
    dp rows. On a (dp=4, tp=2) world this rank (5) is at dp 2, tp 1; Shard(0), Shard(1) and (norms under
    SequenceParallel) Replicate pieces."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import SequenceParallel

    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    reference = Block()
    with torch.device("meta"):
        model = Block()
    plan = _block_plan()
    if sequence_parallel:
        plan.update({"norm1": SequenceParallel(), "norm2": SequenceParallel()})
    parallelize_module(model, mesh["tp"], plan)
    torch.manual_seed(0)
    fsdp_graph.fully_shard(model, mesh["dp"])
    tp_dims = {"q": 0, "k": 0, "v": 0, "up": 0, "o": 1, "down": 1}
    views = dict(model.named_parameters())
    for name, full in reference.named_parameters():
        module, kind = name.split(".")
        piece = full.detach()
        if module in tp_dims and not (module in ("o", "down") and kind == "bias"):  # Rowwise biases: Replicate
            piece = piece.chunk(2, dim=tp_dims[module])[1]
        view = views[name].to_local() if isinstance(views[name], DTensor) else views[name]
        assert view.device.type == "cpu" and torch.equal(view.detach(), piece.chunk(4)[2]), name


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"sync_module_states": True}, "sync_module_states=True .*a broadcast from rank 0 would overwrite"),
        ({"cpu_offload": fsdp_graph.CPUOffload(offload_params=True)}, "cpu_offload .*not tested yet"),
    ],
)
def test_error_options_not_supported_with_tp(fake_pg, options, message):
    mesh, model = _mesh(), Block()
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel()})
    with pytest.raises(NotImplementedError, match=rf"{message}"):
        fsdp_graph.fully_shard(model, mesh["dp"], **options)
    assert not hasattr(model, "_fsdp_root")  # refused before anything was sharded


def test_error_reshard_after_forward_int_with_tp(fake_world_8):
    # Other dimension names than the 3-D mesh of the next test: torch's DeviceMesh bookkeeping maps an equal
    # sub-mesh (same name, same ranks) to the root mesh first registered, even after the process group changed.
    mesh, model = init_device_mesh("cpu", (4, 2), mesh_dim_names=("data", "model")), Block()
    parallelize_module(model, mesh["model"], {"up": ColwiseParallel()})
    with pytest.raises(NotImplementedError, match=r"reshard_after_forward=int with tensor-parallel .*'up.weight'"):
        fsdp_graph.fully_shard(model, mesh["data"], reshard_after_forward=2)


def test_tp_mesh_from_an_equal_world_made_earlier(fake_world_8):
    """DTensor caches specs by value: after a plan on one world's "m", a plan on the equal "m" (same name, same
    ranks) of a world made later leaves the parameters on the FIRST world's mesh. fully_shard must judge the tp
    mesh by its name and ranks, not by which world object it hangs from, and keep the later world's dimension.
    Names of their own: the cache outlives this test's process group."""
    first = init_device_mesh("cpu", (4, 2), mesh_dim_names=("d", "m"))
    parallelize_module(Block(), first["m"], {"up": ColwiseParallel()})
    world, model = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("r", "s", "m")), Block()
    parallelize_module(model, world["m"], {"up": ColwiseParallel()})
    assert model.up.weight.device_mesh._get_root_mesh().mesh_dim_names == ("d", "m")  # the case under test
    fsdp_graph.fully_shard(model, world["r", "s"], strategy=fsdp_graph.ShardingStrategy.HYBRID_SHARD)
    from fsdp_graph.runtime.unit import flat_params

    spec = next(spec for state in flat_params(model) for spec in state.tp if spec is not None)
    assert spec.mesh._get_root_mesh() is world and spec.mesh.mesh.tolist() == [4, 5]


def test_hybrid_shard_with_tp_on_a_3d_mesh(fake_world_8):
    """HSDP x TP: HYBRID_SHARD over ("replicate", "shard"), the plan on "tp". The backward adds the replicate
    all-reduce after our reduce-scatter; state dicts are DTensors on the 3-D mesh (plain parameters on the 2-D one)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    mesh, model = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp")), Block()
    plan = _block_plan()
    parallelize_module(model, mesh["tp"], plan)
    fsdp_graph.fully_shard(model, mesh["replicate", "shard"], strategy=fsdp_graph.ShardingStrategy.HYBRID_SHARD)
    backend = fsdp_graph.make_backend(inductor=False)
    torch.compile(model, backend=backend, fullgraph=True)(torch.randn(2, 3, 16, requires_grad=True)).sum().backward()
    assert backend.dynamo_graphs == 1
    text = _group_sizes(backend, {(5, 7): "shard", (4, 5): "tp", (1, 5): "replicate"})
    assert text.splitlines()[-2:] == [
        "bw: reduce_scatter_tensor(group=shard, reduce_op=sum, group_size=2, 1160 x float32 -> 580 x float32)",
        "bw: all_reduce(group=replicate, reduce_op=sum, 580 x float32 -> 580 x float32)",
    ], text
    assert text.count("group=tp,") == 6, text
    state = model.state_dict()
    expected = {
        "q.weight": (("replicate", "shard", "tp"), (Replicate(), _StridedShard(0, split_factor=2), Shard(0))),
        "o.weight": (("replicate", "shard", "tp"), (Replicate(), Shard(0), Shard(1))),
        "o.bias": (("replicate", "shard", "tp"), (Replicate(), Shard(0), Replicate())),
        "norm1.weight": (("replicate", "shard"), (Replicate(), Shard(0))),
    }
    for name, (dims, placements) in expected.items():
        assert (state[name].device_mesh.mesh_dim_names, tuple(state[name].placements)) == (dims, placements), name
    assert state["q.weight"].to_local().shape == (4, 16)  # 16 rows / tp 2 / shard 2
    # The optimizer's views: all on the 3-D mesh, a plain norm replicated over tp after HYBRID's placements.
    params = dict(model.named_parameters())
    assert {p.device_mesh.mesh_dim_names for p in params.values()} == {("replicate", "shard", "tp")}
    assert tuple(params["norm1.weight"].placements) == (Replicate(), Shard(0), Replicate())
    assert tuple(params["q.weight"].placements) == expected["q.weight"][1]


@pytest.mark.parametrize("prepared", [False, True])
def test_explain_sizes_tp_collectives_by_the_tp_group(fake_pg, prepared):
    """explain() on a (dp=2, tp=2) world: DTensor's all-reduces are sized by the tp dimension's group (2 ranks, not
    the world's 4), and the plan's bytes per mesh dimension equal the ones the 4-rank run measures
    (tests/numerics/test_tensor_parallel.py), both derived by `llama_minimum_bytes` from the shapes."""
    pytest.importorskip("transformers")
    from tests.workers.hf_models import build_hf, make_batch
    from tests.workers.tensor_parallel import LLAMA_UNITS, LLAMA_VOCAB, llama_minimum_bytes, llama_tp_plan

    torch.manual_seed(0)
    mesh, model = _mesh(), build_hf("llama", LLAMA_VOCAB)
    parallelize_module(model, mesh["tp"], llama_tp_plan(prepared))
    fsdp_graph.fully_shard(model, mesh["dp"])
    report = fsdp_graph.explain(model, example_kwargs=make_batch(torch.Generator().manual_seed(5), 4))
    expected = llama_minimum_bytes(prepared, batch=4, seq=16)
    by_group = report.sent_bytes_by_group
    assert by_group == pytest.approx({"dp": expected["dp_gather"] + expected["dp_reduce"], "tp": expected["tp"]})
    assert report.sent_bytes == pytest.approx(sum(expected.values()))
    assert [r.unit for r in report.units] == LLAMA_UNITS
    assert [(r.gathers, r.reduce_scatters) for r in report.units] == [(1, 1)] + [(2, 1)] * 4  # the embedding: 1
    assert report.other_collectives == {("all_reduces", "None"): 2 * (2 + (2 if prepared else 5))}
    text = report.to_text()
    assert "sent per step, by group: dp (2 ranks) 0.369 MiB, tp (2 ranks)" in text, text


def _tp_block(layout: str = "rows", **options):
    mesh, model = _mesh(), Block()
    plan = _block_plan()
    parallelize_module(model, mesh["tp"], plan)
    return fsdp_graph.fully_shard(model, mesh["dp"], layout=layout, **options)


def _aliases_shard(model, name: str) -> bool:
    """Whether parameter `name`'s local tensor lies inside the block's flat shard (same storage, its range)."""
    from fsdp_graph.runtime.unit import flat_params

    shard, local = flat_params(model)[0].flat_shard, dict(model.named_parameters())[name].to_local()
    start = local.data_ptr() - shard.data_ptr()
    same = local.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()
    return same and 0 <= start and start + local.numel() * local.element_size() <= shard.numel() * shard.element_size()


def test_tp_views_are_dtensors_on_dp_tp_around_the_flat_shard(fake_pg):
    """The optimizer's view of a tp parameter is a DTensor of the global parameter on (dp, tp) with the state
    dict's placements, whose local tensor is its row block inside the flat shard. The other parameters are DTensors
    on the same mesh, replicated over tp, while their state-dict entries stay on dp (as FSDP2 + TP's)."""
    from torch.distributed.tensor import DTensor

    model = _tp_block()
    params = dict(model.named_parameters())
    state = model.state_dict()
    for name in ("q.weight", "q.bias", "o.weight", "o.bias"):
        p = params[name]
        assert isinstance(p, DTensor) and isinstance(p, torch.nn.Parameter), name
        assert p.device_mesh.mesh_dim_names == ("dp", "tp") and p.placements == state[name].placements, name
        assert p.shape == Block().get_parameter(name).shape and _aliases_shard(model, name), name
    assert p.to_local().shape == (8,)  # o.bias: 16 / dp 2, replicated over tp
    assert params["q.weight"].to_local().shape == (4, 16)  # 16 rows / tp 2 / dp 2
    norm = params["norm1.weight"]
    assert isinstance(norm, DTensor) and norm.device_mesh.mesh_dim_names == ("dp", "tp")
    assert tuple(norm.placements) == (Shard(0), Replicate()) and norm.shape == (16,)
    assert norm.to_local().shape == (8,) and _aliases_shard(model, "norm1.weight")
    assert state["norm1.weight"].device_mesh.mesh_dim_names == ("dp",)
    assert tuple(state["norm1.weight"].placements) == (Shard(0),) and state["norm1.weight"].shape == (16,)
    with torch.no_grad():  # an in-place update of the DTensor writes the flat shard
        params["q.weight"].fill_(3.0)
    assert (state["q.weight"].to_local() == 3.0).all()
    params["q.weight"].requires_grad_(False)  # a DTensor view reports the change to its flat parameter too
    state = next(s for s in flat_params(model) if any(v is params["q.weight"] for v in s.views))
    assert [i for i, v in enumerate(state.views) if v is params["q.weight"]] == list(state.detached_slots)


def test_tp_dtensor_grads_accumulate_keep_low_precision_and_survive_double(fake_pg):
    """`.grad` of a tp view is a DTensor with its spec (bf16 under keep_low_precision_grads, around the reduced
    piece); a second backward adds into it; `.double()` re-points the same view objects at the new flat shard."""
    from torch.distributed.tensor import DTensor

    from fsdp_graph.runtime.misuse import ShardedDTensor

    mp = fsdp_graph.MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True)
    model = _tp_block(mixed_precision=mp)
    weight = dict(model.named_parameters())["q.weight"]
    x = torch.randn(2, 3, 16)
    model(x).float().sum().backward()
    grad = weight.grad
    assert isinstance(grad, DTensor) and grad.dtype == torch.bfloat16 and grad.to_local().dtype == torch.bfloat16
    assert grad.placements == weight.placements and grad.shape == weight.shape
    first = grad.to_local().clone()
    model(x).float().sum().backward()
    assert weight.grad is grad and torch.equal(grad.to_local(), first + first)
    model.zero_grad()
    assert weight.grad is None
    model.double()
    assert dict(model.named_parameters())["q.weight"] is weight and type(weight) is ShardedDTensor
    assert weight.dtype == weight.to_local().dtype == torch.float64 and _aliases_shard(model, "q.weight")


def test_tp_views_with_the_flat_layout_stay_plain(fake_pg):
    from torch.distributed.tensor import DTensor

    model = _tp_block(layout="flat")
    assert not any(isinstance(p, DTensor) for p in model.parameters())


class _BlockWithHead(torch.nn.Module):
    """A tp block followed by a plain head whose 3 rows split unevenly over dp 2 (2 rows on dp rank 0, 1 on 1)."""

    def __init__(self):
        super().__init__()
        self.block, self.head = Block(), torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def test_all_views_are_dtensors_on_one_mesh_and_foreach_optimizers_step_them(fake_pg):
    """With tp parameters every view is a DTensor on (dp, tp): the non-tp ones (norms, the uneven head) with
    (Shard(0), Replicate()) and DTensor's own row split as local shape. Foreach SGD and AdamW step the one list, and
    foreach zero_grad(set_to_none=False) zeroes it, with no global optimizer hooks of ours and implicit replication
    off; SGD's update of each local tensor is the plain one (lr x gradient)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    mesh, model = _mesh(), _BlockWithHead()
    plan = {f"block.{n}": ColwiseParallel() for n in ("q", "k", "v", "up")}
    plan.update({"block.o": RowwiseParallel(), "block.down": RowwiseParallel()})
    parallelize_module(model, mesh["tp"], plan)
    fsdp_graph.fully_shard(model, mesh["dp"])
    params = dict(model.named_parameters())
    assert all(isinstance(p, DTensor) for p in params.values()) and len({p.device_mesh for p in params.values()}) == 1
    head = params["head.weight"]
    assert tuple(head.placements) == (Shard(0), Replicate()) and head.shape == (3, 16)
    local_shape, _ = compute_local_shape_and_global_offset(head.shape, head.device_mesh, head.placements)
    assert tuple(head.to_local().shape) == tuple(local_shape) == (2, 16)
    ours = [h for h in (*_global_optimizer_pre_hooks.values(), *_global_optimizer_post_hooks.values())]
    assert not any(h.__module__ == "fsdp_graph.runtime.dtensor_views" for h in ours)

    model(torch.randn(2, 3, 16)).sum().backward()
    assert all(isinstance(p.grad, DTensor) and p.grad.placements == p.placements for p in params.values())
    before = {n: p.to_local().detach().clone() for n, p in params.items()}
    grads = {n: p.grad.to_local().clone() for n, p in params.items()}
    sgd = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, foreach=True)
    sgd.step()
    assert not DTensor._op_dispatcher._allow_implicit_replication
    for name, p in params.items():
        torch.testing.assert_close(p.to_local(), before[name] - 0.5 * grads[name], msg=name)
    sgd.zero_grad(set_to_none=False)
    assert all(isinstance(p.grad, DTensor) and not p.grad.to_local().any() for p in params.values())
    adamw = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True)
    model(torch.randn(2, 3, 16)).sum().backward()
    adamw.step()
    assert all(isinstance(adamw.state[p]["exp_avg"], DTensor) for p in params.values())
    assert all(torch.isfinite(p.to_local()).all() for p in params.values())


def test_undescribable_tp_row_blocks_keep_every_view_plain(fake_pg):
    """A Colwise weight with 3 rows per tp rank has uneven dp blocks, which no DTensor placement describes: then
    every view of the call stays plain, the describable Rowwise ones too (not a mix, which foreach optimizers
    refuse), and foreach SGD steps them."""
    from torch.distributed.tensor import DTensor

    mesh = _mesh()
    model = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 6), torch.nn.Linear(6, 16))
    parallelize_module(model, mesh["tp"], {"1": ColwiseParallel(), "2": RowwiseParallel()})
    fsdp_graph.fully_shard(model, mesh["dp"])
    params = list(model.parameters())
    assert not any(isinstance(p, DTensor) for p in params)
    # 6 Colwise rows / tp 2 = 3, / dp 2: 2 on rank 0; the Rowwise weight's tp piece (16, 3), its bias replicated.
    assert [tuple(p.shape) for p in params] == [(8,), (8,), (2, 16), (2,), (8, 3), (8,)]
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    torch.optim.SGD(params, lr=0.5, foreach=True).step()
    assert all(torch.equal(p, b - 0.5) for p, b in zip(params, before))


def compile_key_on_rank(rank: int, dtensor_output: bool = False) -> tuple[str, str, list[str]]:
    """(the Dynamo graph's code, the key its compiled code and collective lists are kept under, the lowered graphs'
    group names) on `rank` of a fake (dp=2, tp=2) world. `dtensor_output`: a Colwise linear whose output stays a
    DTensor, so the graph returns one. Once per process: DTensor keeps meshes it has seen (by value, not by group)
    across process groups, so a second fake rank in the same process would reuse the first one's groups."""
    from unittest import mock

    from fsdp_graph.compiler import rank_check

    seen = []
    key = rank_check.FingerprintStore.key

    def recording(backend_key, gm, example_inputs):
        seen.append((gm.code, key(backend_key, gm, example_inputs)))
        return seen[-1][1]

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
    try:
        with mock.patch.object(rank_check.FingerprintStore, "key", staticmethod(recording)):
            torch._dynamo.reset()
            torch.manual_seed(0)
            mesh = _mesh()
            if dtensor_output:
                model = torch.nn.Sequential(torch.nn.Linear(16, 16))
                parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(use_local_output=False)})
            else:
                model = Block()
                parallelize_module(model, mesh["tp"], _block_plan())
            fsdp_graph.fully_shard(model, mesh["dp"])
            backend = fsdp_graph.make_backend(inductor=False)
            out = torch.compile(model, backend=backend, fullgraph=True)(torch.randn(2, 3, 16, requires_grad=True))
            (out.full_tensor() if dtensor_output else out).sum().backward()
    finally:
        dist.destroy_process_group()
    (only,) = seen
    return (*only, sorted({g for report in backend.reports for g in report.groups}))


def _start(rank: int, dtensor_output: bool) -> subprocess.Popen:
    """`compile_key_on_rank(rank, dtensor_output)` in a process of its own (`_result` waits for it)."""
    script = "import json, sys; from tests.graphs.test_tensor_parallel import compile_key_on_rank as k; "
    script += f"print(json.dumps(k({rank}, {dtensor_output})))"
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)


def _result(run: subprocess.Popen) -> tuple[str, str, list[str]]:
    out = run.communicate()[0]
    assert run.returncode == 0, out
    return tuple(json.loads(out.strip().splitlines()[-1]))


def test_ranks_of_differently_named_tp_groups_compile_the_same_code():
    """Ranks 0 and 2 of a 2 x 2 mesh trace the same Dynamo graph, but c10d names their tp groups ([0, 1], [2, 3])
    and dp groups ([0, 2], [1, 3]) differently. The lowered graphs name rank-independent aliases of them (the tp
    collectives AOT autograd traces out of DTensor code, fully_shard's gathers), so both ranks key their compile
    alike and one compile serves both (`shared_compile`). A graph that returns a DTensor: AOT autograd's wrappers
    (and a cached entry of them) hold its mesh, which names c10d's groups, so its tp collectives keep c10d's names
    and the ranks key apart; keyed alike, a warm cache handed one rank's code to the other ("Could not resolve the
    process group registered under the name 3")."""
    runs = [_start(2, False), _start(0, True), _start(2, True)]  # beside this process's rank 0
    code_0, key_0, groups_0 = compile_key_on_rank(0)
    code_2, key_2, groups_2 = _result(runs[0])
    assert code_0 == code_2 and key_0 == key_2
    assert groups_0 == groups_2 and len(groups_0) == 2 and all(g.startswith("fsdp_graph:") for g in groups_0)
    assert any(g.startswith("fsdp_graph:dtensor:") for g in groups_0)
    (code_0, key_0, groups_0), (code_2, key_2, groups_2) = _result(runs[1]), _result(runs[2])
    assert code_0 == code_2 and key_0 != key_2 and groups_0 != groups_2
