"""The default wrap's embedding and head units on 2 gloo ranks: SGD parity of an untied Llama with single-process
training, and the largest all-gather of a step no larger than the largest single piece."""

from fsdp_graph.train.launch import spawn
from tests.workers.edge_units import untied_llama_sgd_parity


def test_untied_llama_default_units_parity_and_largest_gather():
    for r in spawn(untied_llama_sgd_parity, 2):
        assert r["units"] == 7, r  # 4 blocks, embedding, head, root (final norm)
        assert r["loss_drop"] > 0.1 and r["param_change"] > 1e-2, r  # the comparison is not vacuous
        assert r["loss_diff"] < 1e-5 and r["param_diff"] < 1e-5, r
        # Every unit gathers in forward; in backward all but the embedding (its backward needs no weight).
        assert r["collectives"] == [("fw", {"all_gather": 7}), ("bw", {"all_gather": 6, "all_to_all": 7})], r
        assert r["largest_gather"] <= r["largest_piece"] < r["embedding_plus_head"], r
