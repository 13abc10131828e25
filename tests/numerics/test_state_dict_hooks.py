"""Modules with state-dict code of their own under fully_shard (issue 24): a fused projection split on save and
merged on load, legacy key renames, a dtype cast, a non-persistent buffer, `torch.nn.utils.parametrize` (weight norm
and a custom one) and a `_load_from_state_dict` override that migrates an old version, at world 1, 2 and 4, in both
layouts. Each module's code sees DTensors as under FSDP2, so the sharded and full state dicts equal the unsharded
model's, DCP round trips and full-tensor loads are exact, and checkpoints move both ways with torch's FSDP2."""

import pytest

from fsdp_graph.train.launch import spawn
from tests.workers import titan
from tests.workers.state_dict_corpus import check, titan_check


@pytest.mark.parametrize("world", [1, 2, 4])
def test_corpus_state_dicts_equal_the_unsharded_model(tmp_path, world):
    for rank_results in spawn(check, world, (str(tmp_path),)):
        assert rank_results and all(value == 0.0 for value in rank_results.values()), rank_results


@pytest.mark.skipif(titan.available() is not None, reason=str(titan.available()))
@pytest.mark.parametrize(
    "family, flavor, layers, layouts",
    [("llama3", "debugmodel", 2, ("rows", "flat")), ("qwen3", "debugmodel_moe", 1, ("rows",))],
)
def test_torchtitan_state_dicts_equal_the_unsharded_model(tmp_path, family, flavor, layers, layouts):
    """torchtitan 0.3.0's models split fused QKV weights on save and merge them on load (Qwen3's MoE: one layer of
    its 64 experts, the rows layout only, to keep the suite's time)."""
    for rank_results in spawn(titan_check, 2, (str(tmp_path), family, flavor, layers, layouts)):
        assert rank_results and all(value == 0.0 for value in rank_results.values()), rank_results
