"""Compiled artifacts in a checkpoint (issue 36) that do not apply are ignored in one line (one process, no compile).
The resume that loads them instead of compiling: tests/numerics/test_shared_compile.py."""

import os
import warnings

import torch

import fsdp_graph
from fsdp_graph.compiler.compiled_files import CompiledFiles, machine_id
from tests.workers.models import OddMLP


class _OtherForward(OddMLP):
    """OddMLP's parameters (its checkpoint loads) with another forward: compiled code for OddMLP does not apply."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).relu()


def _warnings_of(path: str, model, backend, **kwargs) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fsdp_graph.load_checkpoint(path, model, compiled=backend, **kwargs)
    return [str(w.message) for w in caught]


def test_artifacts_for_other_options_or_another_model_or_damaged_are_ignored_in_one_line(tmp_path, one_rank):
    """One process, no compile: a backend holding an entry torch cannot load. Other backend options, another model
    (same parameters, another module class), the entry torch rejects, and a file whose bytes changed (with the
    load's own manifest check off) each give exactly one warning line saying why, and the weights still load."""
    path = str(tmp_path / "ckpt")
    torch.manual_seed(0)
    model = fsdp_graph.fully_shard(OddMLP())
    backend = fsdp_graph.make_backend()
    backend.compiled["graph"] = CompiledFiles(b"not an artifact", {}, machine_id())
    fsdp_graph.save_checkpoint(path, model, compiled=backend)

    cases = [
        (fsdp_graph.make_backend(bucket_bytes=4096), fsdp_graph.fully_shard(OddMLP()), "other backend options"),
        (fsdp_graph.make_backend(), fsdp_graph.fully_shard(_OtherForward()), "compiled for another model"),
        (fsdp_graph.make_backend(), fsdp_graph.fully_shard(OddMLP()), "partly ignored on rank 0: graph "),
    ]
    for load_backend, load_model, why in cases:
        lines = _warnings_of(path, load_model, load_backend)
        assert len(lines) == 1 and why in lines[0] and "\n" not in lines[0], (why, lines)
        assert load_backend.restored["graphs"] == 0, why
        for name, value in model.state_dict().items():
            assert torch.equal(load_model.state_dict()[name].full_tensor(), value.full_tensor()), (why, name)

    with open(os.path.join(path, "compiled", "graph_0.bin"), "r+b") as f:
        f.write(b"N")
    lines = _warnings_of(path, fsdp_graph.fully_shard(OddMLP()), fsdp_graph.make_backend(), verify_files=False)
    assert len(lines) == 1 and "graph_0.bin differs from checksums.json" in lines[0], lines


def test_the_precompiled_header_is_built_only_before_a_kernel_is_compiled(tmp_path, monkeypatch):
    """`deferred_header`: torch's header precompile (a stand-in keeping its contract: cached per arguments, the
    build handed to `_worker_compile_cpp`) is not built for a kernel whose library is in the cache, and is built
    before the first kernel that is compiled; torch's functions are back after the block."""
    import functools
    from pathlib import Path

    from torch._inductor import codecache

    from fsdp_graph.compiler.deferred_header import deferred_header

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    built: list[str] = []
    monkeypatch.setattr(codecache, "_worker_compile_cpp", lambda lock, builders: built.extend(builders))

    @functools.cache
    def precompile(header: str, command: str) -> str:
        codecache._worker_compile_cpp(f"{header}.lock", (f"{header}.gch",))
        return header

    monkeypatch.setattr(codecache, "_precompile_header", precompile)

    def load_kernel(source: str, library_there: bool) -> None:  # as CppCodeCache.load_async: write, then header
        _, path = codecache.write(source, "main.cpp")
        if library_there:
            Path(path).with_suffix(".so").write_bytes(b"")
        codecache._precompile_header("prefix.h", "g++ -O3")

    with deferred_header():
        load_kernel("// cached kernel", library_there=True)
        load_kernel("// another cached kernel", library_there=True)
        assert built == []
        load_kernel("// a kernel to compile", library_there=False)
        assert built == ["prefix.h.gch"]
        load_kernel("// one more to compile", library_there=False)
        assert built == ["prefix.h.gch"]
    assert codecache._precompile_header is precompile and codecache.write.__name__ == "write"


def test_artifacts_compiled_with_other_torch_compile_options_are_ignored_at_the_compile_in_one_line(
    tmp_path, one_rank, monkeypatch
):
    """torch.compile's `options=` reach the backend only when it compiles: a checkpoint's artifacts compiled with
    other options install, and the first compile says in one line that they do not apply (torch's cache keys miss
    them); with the same options nothing is said, and the graph loads instead of compiling."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    path = str(tmp_path / "ckpt")
    torch.manual_seed(0)
    saved_options = {"max_fusion_size": 32}

    def compiled_step(backend, options: dict) -> list[str]:
        model = fsdp_graph.fully_shard(OddMLP())
        lines = _warnings_of(path, model, backend) if os.path.exists(path) else []
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():  # one graph (inference) to compile: what is checked is the same for training's two
                torch.compile(model, backend=backend, options=options)(torch.randn(3, 7))
        if not os.path.exists(path):
            fsdp_graph.save_checkpoint(path, model, compiled=backend)
        return lines + [str(w.message) for w in caught if "compiled artifacts" in str(w.message)]

    assert compiled_step(fsdp_graph.make_backend(), saved_options) == []
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "empty"))
    counters.clear()
    assert compiled_step(fsdp_graph.make_backend(), saved_options) == []
    assert counters["inductor"]["fxgraph_cache_hit"] >= 1 and counters["inductor"]["fxgraph_cache_miss"] == 0

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # its headers built: a cheaper miss
    lines = compiled_step(fsdp_graph.make_backend(), {"max_fusion_size": 16})
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "compiled with torch.compile options (max_fusion_size=32)" in lines[0], lines
    assert "this compile has (max_fusion_size=16)" in lines[0], lines
