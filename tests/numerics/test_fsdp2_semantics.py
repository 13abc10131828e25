"""Issue 32: what torch's FSDP2 accepts and `fsdp_graph.fsdp2` refused, now supported, each against torch's FSDP2
on the same code (2 gloo ranks, SGD with momentum, eager and compiled with eager kernels; ONE spawn,
tests/workers/fsdp2_semantics.py):

- requires_grad changed after the calls: test_fully_shard_frozen.py's test_train_mixed_requires_grad_across_groups
  (a step under no_grad, unfrozen for the last step; reshard_after_forward True and False, compiled True) and
  test_train_mixed_requires_grad_per_group with freeze_after_init (BitFit, then all unfrozen, one parameter frozen
  before the calls too), and a parameter frozen in every block then unfrozen in one (compiled, that block may run
  another block's reused body): losses, gradients (None where FSDP2's are None) and parameters equal;
- `load_state_dict(assign=True)` into a model sharded on meta, as torchtune 0.6.1's
  `load_from_full_model_state_dict` and accelerate 1.15.0's `cpu_ram_efficient_loading` do it: the loaded weights
  are exactly the checkpoint's, and training continues as FSDP2's;
- `MixedPrecisionPolicy(output_dtype=bf16)` with accelerate's bf16 policy: the same output dtype and numbers;
- parameters of one flat parameter that the loss reaches in some steps only (an unused output; compiled, autograd
  gives it zeros): no gradient where FSDP2 gives none, accumulation kept;
- a meta-device model with `CPUOffloadPolicy` (test_fully_shard_state_dict.py::test_dp_state_dict_cpu_offload: loaded
  one parameter at a time with assign, some still on meta; and `to_empty()` then an init).
"""

import pytest

from fsdp_graph.train.launch import spawn
from tests.workers.fsdp2_semantics import MODES, semantics_checks


@pytest.fixture(scope="module")
def results():
    return spawn(semantics_checks, 2)


def _each(results, name: str):
    for r in results:
        assert "error" not in r[name], r[name].get("error")
        yield r[name]


def _same_as_fsdp2(r: dict, suffix: str = "") -> None:
    assert r[f"same_grads{suffix}"] == 1.0, r  # frozen parameters get no gradient, as FSDP2's
    for key in ("loss_diff", "grad_diff", "param_diff"):  # measured: 0 (the same kernels and reductions)
        assert r[f"{key}{suffix}"] < 1e-6, (key + suffix, r)


@pytest.mark.parametrize("mode", MODES)
def test_parameters_the_loss_does_not_reach_get_no_gradient_as_fsdp2(results, mode):
    for r in _each(results, f"unreached_in_flat_param[{mode}]"):
        _same_as_fsdp2(r)


@pytest.mark.parametrize("mode", MODES)
def test_requires_grad_changed_across_groups_trains_as_fsdp2(results, mode):
    for r in _each(results, f"frozen_across_groups[{mode}]"):
        for reshard in ("True", "False") if mode == "eager" else ("True",):
            _same_as_fsdp2(r, f"_{reshard}")
            if mode == "compiled":  # frozen, under no_grad, unfrozen: one graph each
                assert r[f"graphs_{reshard}"] == 3.0, r


@pytest.mark.parametrize("mode", MODES)
def test_requires_grad_changed_inside_a_flat_parameter_trains_as_fsdp2(results, mode):
    for r in _each(results, f"frozen_in_group[{mode}]"):
        for case, graphs in (("bitfit", 3.0), ("one_block", 2.0)):
            _same_as_fsdp2(r, f"_{case}")
            if mode == "compiled":  # one graph before the first change, one after each
                assert r[f"graphs_{case}"] == graphs, r


@pytest.mark.parametrize("mode", MODES)
def test_torchtune_assign_load_into_a_meta_model_is_exact(results, mode):
    for r in _each(results, f"assign_torchtune[{mode}]"):
        assert r["keys_False"] == r["keys_True"] == 1.0, r  # strict: no missing or unexpected key, as FSDP2
        assert r["round_trip_diff"] == 0.0 and r["same_keys"] == 1.0 and r["tied"] == 1.0, r
        _same_as_fsdp2(r)


@pytest.mark.parametrize("mode", MODES)
def test_accelerate_cpu_ram_efficient_loading_and_bf16_output_dtype_match_fsdp2(results, mode):
    for r in _each(results, f"assign_accelerate[{mode}]"):
        assert r["round_trip_diff"] == 0.0 and r["output_dtype_same"] == 1.0, r
        _same_as_fsdp2(r)
        assert r.get("graphs", 1.0) == 1.0, r


@pytest.mark.parametrize("mode", MODES)
def test_meta_model_with_cpu_offload_loads_and_trains_as_fsdp2(results, mode):
    for r in _each(results, f"meta_offload[{mode}]"):
        for flow in ("pieces", "init"):
            assert r[f"cpu_{flow}"] == 1.0 and r[f"loaded_{flow}"] == 0.0, r
            _same_as_fsdp2(r, f"_{flow}")
