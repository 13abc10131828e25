"""One schema per compile region while AOT autograd traces a graph (issue 15: compile time flat in depth).

torch 2.13's autograd rule for `invoke_subgraph` (`HigherOrderOperator.py_autograd_impl`) calls
`invoke_subgraph.gen_schema` on every call, only to refuse bodies that mutate an input in training; `gen_schema`
re-traces the whole body each time (`materialize_as_graph`). `fully_shard(reuse_blocks=True)` calls one body once
per block, and AOT autograd dispatches each call twice (metadata collection, joint trace): at 80 Llama-70B layers
that was 160 re-traces, 31 of the 35 seconds AOT spent (docs/design-notes.md, "Compile once per block"). torch
already caches the same schema for functionalization (`InvokeSubgraphCache.functionalize_schema_cache`, keyed by
the subgraph object, the identifier and the operand types); the autograd rule's call has no cache.

`cached_region_schemas()` gives it one for the duration of a compile: the first call for a (body, identifier,
operand metadata) runs torch's own `gen_schema`, so a body that mutates its input is still refused exactly as
before; later calls with the same key return that schema. The cache holds the body object, so its `id` cannot be
reused within the compile (nor an operand's, for operands keyed by identity), and is dropped when the compile ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def _operand_key(operand: object) -> tuple:
    if isinstance(operand, torch.Tensor):
        return (
            type(operand),
            tuple(str(size) for size in operand.shape),
            tuple(str(stride) for stride in operand.stride()),
            operand.dtype,
            operand.device,
            operand.requires_grad,
        )
    if isinstance(operand, (int, float, bool, str, type(None))):
        return (type(operand), operand)
    return (type(operand), id(operand))


@contextlib.contextmanager
def cached_region_schemas() -> Iterator[None]:
    """While it is open, `invoke_subgraph.gen_schema` computes one schema per body and operand metadata."""
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    if "gen_schema" in vars(invoke_subgraph):  # already open (a compile inside a compile): one cache suffices
        yield
        return
    compute = invoke_subgraph.gen_schema
    schemas: dict[tuple, tuple[object, tuple, object]] = {}

    def gen_schema(subgraph, identifier, *operands):
        key = (id(subgraph), identifier, tuple(_operand_key(o) for o in operands))
        if key not in schemas:
            schemas[key] = (subgraph, operands, compute(subgraph, identifier, *operands))
        return schemas[key][2]

    invoke_subgraph.gen_schema = gen_schema
    try:
        yield
    finally:
        del invoke_subgraph.gen_schema
