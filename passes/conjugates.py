"""Joint-graph pass: lazy conjugates become materialised ones, so a complex tensor can cross a compile region's
boundary (torchtitan's complex RoPE in a shared block body).

`aten._conj` returns a view carrying the Conjugate dispatch key; the backward of a complex product makes one (the
gradient of `x * cache` reads `cache.conj()`). Inside a `nested_compile_region` body (`fully_shard`'s shared block
body) the partitioner saves it for the body's backward, and torch 2.13's `invoke_subgraph` has no kernel for that key
("could not find kernel for HigherOrderOperator invoke_subgraph at dispatch key DispatchKey.Conjugate").
`aten.conj_physical` computes the same values into a tensor of its own, which crosses the boundary as any tensor does.
The pass runs on every joint graph (the model's and each region body's); outside a body it changes only where the
conjugate's values live.
"""

from __future__ import annotations

import torch
import torch.fx as fx

_LAZY = torch.ops.aten._conj.default
_MATERIALISED = torch.ops.aten.conj_physical.default


def materialize_conjugates(graph: fx.Graph) -> int:
    """In place: every `aten._conj` call of `graph` becomes `aten.conj_physical` on the same argument.

    Matches: `call_function` nodes whose target is `aten._conj.default`. Guarantees: the same values (the complex
    conjugate, materialised); no node of the graph makes a lazily conjugated tensor. Returns how many nodes it
    rewrote. No-op (0) when the graph has none, which is every graph without complex arithmetic in its backward.
    """
    nodes = graph.find_nodes(op="call_function", target=_LAZY)
    for node in nodes:
        node.target = _MATERIALISED
    return len(nodes)
