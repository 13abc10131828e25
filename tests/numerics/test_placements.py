"""Issue 35 (and issue 32 item 3): per-parameter placements and meshes through `fsdp_graph.fsdp2`, against torch's
FSDP2 on the same model, calls and meshes (SGD with momentum; eager, compiled with eager kernels, and one check
with Inductor). One spawn of 2 gloo ranks, one of 4 (tests/workers/placement_checks.py).

2 ranks:
- largest_dim: test_fully_shard_training.py::test_train_parity_single_group_shard_largest_dim and
  ::test_shard_placement_fn_contiguous_params_grads (every parameter `Shard(1)` or `Shard(0)`, its largest dim),
  eager, compiled and with Inductor;
- per_call_policies: calls that differ in mixed precision and CPU offload, over torchtitan's `ParallelDims` "fsdp"
  mesh (an `_unflatten`ed view of its world mesh: a dense model);
- state_dict_save_load: test_fully_shard_state_dict.py::test_dp_state_dict_save_load with
  `use_shard_placement_fn=True` (HSDP at 4 ranks);
- dcp: `Shard(1)` checkpoints into torch's FSDP2 (sharded on dim 0) and back.
4 ranks:
- two_meshes: torchtitan's EP meshes, experts `Shard(1)` on efsdp by `ShardPlacementResult`, the rest on fsdp;
- uneven_experts: 3 experts (`Shard(1)`) and 6 experts (`Shard(0)`, one rank empty) over 4 ranks;
- hsdp_titan: HSDP over torchtitan's (dp_replicate, fsdp) mesh (eager);
- per_call_mesh: a call on its own mesh in bf16 (eager);
- dcp: the 2-rank checkpoints (`Shard(1)`; two meshes) loaded at 4 ranks, and two-mesh checkpoints with torch's
  FSDP2 both ways.
"""

import pytest

from fsdp_graph.train.launch import spawn
from tests.workers import titan
from tests.workers.placement_checks import FOUR_RANKS, MODES, TWO_RANKS, placement_checks_2, placement_checks_4


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("placements"))


@pytest.fixture(scope="module")
def two_ranks(checkpoint_dir):
    if (why := titan.available()) is not None:
        pytest.skip(why)
    return spawn(placement_checks_2, 2, (checkpoint_dir,))


@pytest.fixture(scope="module")
def four_ranks(two_ranks, checkpoint_dir):
    return spawn(placement_checks_4, 4, (checkpoint_dir,))


def _parity(results: list[dict], name: str) -> None:
    for r in results:
        result = r[name]
        assert "error" not in result, result.get("error")
        suffixes = [k[len("loss_diff") :] for k in result if k.startswith("loss_diff")]
        assert suffixes, result
        for s in suffixes:
            assert result[f"moved{s}"] == 1.0, result
            assert result[f"same_placements{s}"] == result[f"state_dict_specs{s}"] == 1.0, result
            assert result[f"contiguous{s}"] == 1.0, result
            diffs = ("loss_diff", "grad_diff", "param_diff", "state_dict_diff")
            assert max(result[f"{k}{s}"] for k in diffs) < 1e-5, (name, result)  # measured: at most 6e-8
            if not name.endswith("[eager]"):
                assert result[f"graphs{s}"] == 1.0, result


@pytest.mark.parametrize("name", [f"{n}[{m}]" for n, (_, modes) in TWO_RANKS.items() for m in (modes or MODES)])
def test_two_ranks(two_ranks, name):
    _parity(two_ranks, name)


@pytest.mark.parametrize("name", [f"{n}[{m}]" for n, (_, modes) in FOUR_RANKS.items() for m in (modes or MODES)])
def test_four_ranks(four_ranks, name):
    _parity(four_ranks, name)


def test_dp_state_dict_save_load_shard_largest_dim(two_ranks, four_ranks):
    for r in [*two_ranks, *four_ranks]:
        result = r["state_dict_save_load[eager]"]
        assert "error" not in result, result.get("error")
        flags = ("dtensors", "shares_storage", "loaded", "kept_storage", "after_forward", "shard_dims")
        assert all(result[k] == 1.0 for k in flags), result


def test_checkpoints_with_torch_fsdp2_and_across_world_sizes(two_ranks, four_ranks):
    for r in [*two_ranks, *four_ranks]:
        assert "error" not in r["dcp[eager]"], r["dcp[eager]"].get("error")
    for r in two_ranks:
        result = r["dcp[eager]"]
        assert result["into_fsdp2"] == result["from_fsdp2"] == 0.0 and result["shard_1_saved"] == 1.0, result
    for r in four_ranks:
        result = r["dcp[eager]"]
        assert result["world_2_to_4_rows"] == result["world_2_to_4_largest"] == 0.0, result
        assert result["two_meshes_world_2_to_4"] == 0.0, result
        assert result["into_fsdp2"] == result["from_fsdp2"] == 0.0, result
        assert result["into_fsdp2_meshes"] == result["from_fsdp2_meshes"] == 1.0, result
