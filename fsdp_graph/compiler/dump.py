"""Readable per-stage graph dumps (DESIGN §6): files under a directory and tlparse artifacts."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.fx as fx
from torch._logging import trace_structured

DUMP_ENV = "FSDP_GRAPH_DUMP"


class GraphDumper:
    """Writes `<dir>/graph_<n>/<stage>.py` for Dynamo graph n, and always emits a tlparse artifact."""

    def __init__(self, directory: str | None, graph_index: int):
        directory = directory or os.environ.get(DUMP_ENV) or None
        self.directory = Path(directory) / f"graph_{graph_index}" if directory else None
        self.graph_index = graph_index
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            (self.directory / "summary.txt").unlink(missing_ok=True)

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def graph(self, stage: str, graph: fx.GraphModule | fx.Graph, header: str = "") -> None:
        def render() -> str:
            if isinstance(graph, fx.GraphModule):
                code = graph.print_readable(print_output=False, include_stride=False, include_device=False)
            else:
                code = graph.python_code("self").src
            return (f'"""{header}"""\n' if header else "") + code

        self.text(f"{stage}.py", render)

    def text(self, filename: str, content: str | Callable[[], str]) -> None:
        """`content` may be a function: it is called (once) only if a dump directory is set or tlparse tracing
        asks for the artifact, so compiles that dump nothing never format graphs."""
        render = functools.cache(content if callable(content) else lambda: content)
        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": f"fsdp_graph_{self.graph_index}_{filename}", "encoding": "string"},
            payload_fn=render,
        )
        if self.directory is not None:
            with open(self.directory / filename, "a" if filename.endswith(".txt") else "w") as f:
                f.write(render())


def no_caches_when_dumping(enabled: bool):
    """Dumps are written while compiling; a cache hit would skip the stages, so dumping disables the caches."""
    if not enabled:
        return contextlib.nullcontext()
    return torch._functorch.config.patch(enable_autograd_cache=False)
