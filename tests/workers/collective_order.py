"""The order of collectives, waits and matmuls, read from a lowered FX graph and from Inductor's generated code.

Both readers produce the same tokens, so a test can assert that Inductor ran what `passes.schedule` placed:
- `<kind>#<i>` for the i-th issued collective of that kind (`all_gather_into_tensor#0`, ...),
- `wait(<kind>#<i>)` for the wait on it,
- `mm` for a matrix multiply (mm, addmm or bmm: Inductor may split a bias off, but the product stays one kernel).
"""

from __future__ import annotations

import re

import torch
import torch.fx as fx

from fsdp_graph.ir import COLLECTIVES, WAIT

_aten = torch.ops.aten
_MATMULS = (_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default)

_ISSUE = re.compile(r"^\s*(\w+) = torch\.ops\._c10d_functional\.(\w+)\.default\(")
_ISSUE_OUT = re.compile(r"^\s*torch\.ops\._c10d_functional\.(\w+)_out\.default\(.*\bout=(\w+)\)")
_WAIT = re.compile(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((\w+)\)")
_MM = re.compile(r"^\s*extern_kernels\.(mm|addmm|bmm|baddbmm)\(")
_KINDS = {op.__name__.split(".")[0] for op in COLLECTIVES}


class _Labeler:
    def __init__(self):
        self.counts: dict[str, int] = {}

    def __call__(self, kind: str) -> str:
        index = self.counts.get(kind, 0)
        self.counts[kind] = index + 1
        return f"{kind}#{index}"


def fx_sequence(gm: fx.GraphModule) -> list[str]:
    """Tokens of a lowered graph, in node order."""
    label, labels, out = _Labeler(), {}, []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in COLLECTIVES:
            labels[node] = label(node.target.__name__.split(".")[0])
            out.append(labels[node])
        elif node.target is WAIT:
            out.append(f"wait({labels.get(node.args[0], '?')})")
        elif node.target in _MATMULS:
            out.append("mm")
    return out


def code_sequence(code: str) -> list[str]:
    """Tokens of one Inductor output module (Python wrapper code), in the order its `call` runs them.
    A collective that writes into a preallocated buffer (`*_out(..., out=buf)`) counts as an issue of its kind."""
    label, labels, out = _Labeler(), {}, []
    for line in code.splitlines():
        if m := _ISSUE.match(line):
            buffer, kind = m.groups()
            if kind in _KINDS:
                labels[buffer] = label(kind)
                out.append(labels[buffer])
        elif m := _ISSUE_OUT.match(line):
            kind, buffer = m.groups()
            if kind in _KINDS:
                labels[buffer] = label(kind)
                out.append(labels[buffer])
        elif m := _WAIT.search(line):
            out.append(f"wait({labels.get(m.group(1), '?')})")
        elif _MM.match(line):
            out.append("mm")
    return out


def prefetched(sequence: list[str]) -> bool:
    """Whether some collective is issued while an earlier one is still in flight (the schedule moved it up)."""
    flying = 0
    for token in sequence:
        if token.startswith("wait("):
            flying -= 1
        elif token != "mm":
            if flying:
                return True
            flying += 1
    return False
