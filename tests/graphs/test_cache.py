"""DESIGN §5 cache rule: our passes are in the compile cache key (fake PG, world 4, full Inductor)."""

import pytest
import torch
from torch._dynamo.utils import counters

import fsdp_graph
from tests.graphs.capture import TwoBlock


def _compile_once(backend) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    # without shared block bodies (the default since issue 25): this checks each block's own nodes
    model = fsdp_graph.fully_shard(TwoBlock(dim=6), reuse_blocks=False)
    torch.compile(model, backend=backend, fullgraph=True)(torch.randn(3, 6)).sum().backward()


@pytest.mark.slow
def test_changed_pass_never_reuses_cached_code(fake_pg, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    counters.clear()
    first = fsdp_graph.make_backend()
    _compile_once(first)
    assert [r.stage for r in first.reports] == ["fw", "bw"]  # the passes ran
    assert counters["aot_autograd"]["autograd_cache_miss"] == 1

    same = fsdp_graph.make_backend()
    _compile_once(same)
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1  # identical passes: the cache serves it
    # the passes did not run: the reports are the ones they made for the cached code
    assert [(r.stage, r.code, r.loaded_from) for r in same.reports] == [(r.stage, r.code, 0) for r in first.reports]

    changed = fsdp_graph.make_backend()
    monkeypatch.setattr(changed, "_uuid", "a-changed-pass")  # what editing any pass module does to the key
    _compile_once(changed)
    assert counters["aot_autograd"]["autograd_cache_miss"] == 2
    assert [(r.stage, r.loaded_from) for r in changed.reports] == [("fw", None), ("bw", None)]


def test_pass_uuid_tracks_options_and_is_stable():
    assert fsdp_graph.make_backend()._cache_key() == fsdp_graph.make_backend()._cache_key()
    assert fsdp_graph.make_backend()._cache_key() != fsdp_graph.make_backend(inductor=False)._cache_key()


_IMPORT_FIRST_IN_FORKS = """
import os, sys, traceback
import torch, torch.distributed, torch.fx  # noqa: F401  (torch's import, the costly part, shared by the forks)

failed = []
for first in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:  # a process where neither `passes` nor `fsdp_graph` was imported yet
        try:
            __import__(first)
            import passes
            import fsdp_graph

            fsdp_graph.make_backend()._cache_key()
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    if os.waitpid(pid, 0)[1] != 0:
        failed.append(first)
print("failed:", failed, file=sys.stderr)
sys.exit(1 if failed else 0)
"""


def test_import_passes_before_fsdp_graph():
    """`import passes` first used to fail with a circular import (issue 12); so may any module of it imported first.
    One Python per module imported first, forked from one that imported only torch (one interpreter start, not 3)."""
    import subprocess
    import sys

    firsts = ["passes", "passes.fx_nodes", "passes.cost"]
    done = subprocess.run([sys.executable, "-c", _IMPORT_FIRST_IN_FORKS, *firsts], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("module", ["passes.fx_nodes", "passes.collective_counts", "passes.lower"])
def test_code_hash_covers_every_passes_module(monkeypatch, module):
    """Editing any module of `passes`, the shared helpers included, changes the compiled code's cache key."""
    import inspect

    from fsdp_graph.compiler import backend

    getsource = inspect.getsource
    backend._code_hash.cache_clear()
    before = backend._code_hash()
    edited = lambda m: getsource(m) + ("\n# edited" if m.__name__ == module else "")  # noqa: E731
    monkeypatch.setattr(backend.inspect, "getsource", edited)
    backend._code_hash.cache_clear()
    try:
        assert backend._code_hash() != before
    finally:
        monkeypatch.undo()
        backend._code_hash.cache_clear()


_PICK_IN_A_FRESH_PROCESS = """
import json, sys
from torch._inductor import config, cpu_vec_isa
from fsdp_graph.compiler.vec_isa import vec_isa_patches

probed = []  # the ISAs torch built and loaded a probe for (its base check; the per-feature ones are left to it)
build = cpu_vec_isa.VecISA.check_build

def counting(self, code):
    if code == cpu_vec_isa.VecISA._avx_code:
        probed.append(str(self))
    return build(self, code)

cpu_vec_isa.VecISA.check_build = counting
patches = vec_isa_patches(sys.argv[1])
with config.patch(patches):  # as the backend compiles
    picked = str(cpu_vec_isa.pick_vec_isa())
usable = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]  # torch's verdict (probed, or trusted by the patch)
with config.patch({"cpp.vec_isa_ok": True}):
    reported = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list.__wrapped__()]
print(json.dumps({"patches": patches, "picked": picked, "probed": probed, "all_usable": usable == reported}))
"""


def test_vec_isa_is_probed_once_per_machine_not_per_process(tmp_path):
    """Inductor probes each vector ISA the CPU reports (a probe library and a child Python process each) before the
    first kernel of every process loads, from its cache too: ~0.9 CPU seconds of a warm restart. The first process
    records torch's verdict (here in `tmp_path`; the probe libraries stay in Inductor's cache); a later one picks the
    same ISA without probing."""
    import json
    import os
    import subprocess
    import sys

    from torch._inductor import config

    from fsdp_graph.compiler.vec_isa import vec_isa_patches

    env = {name: value for name, value in os.environ.items() if name != "TORCHINDUCTOR_VEC_ISA_OK"}
    command = [sys.executable, "-c", _PICK_IN_A_FRESH_PROCESS, str(tmp_path)]
    runs = [subprocess.run(command, env=env, capture_output=True, text=True) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    first, second = (json.loads(r.stdout.strip().splitlines()[-1]) for r in runs)
    assert first["probed"], first  # torch's own probe decided, once
    # every reported ISA usable: the patch, and no probe again; else torch keeps probing in every process
    assert first["patches"] == ({"cpp.vec_isa_ok": True} if first["all_usable"] else {}), first
    assert second["picked"] == first["picked"] and second["patches"] == first["patches"]
    assert bool(second["probed"]) == (not second["patches"]), second
    # a user's setting is never overridden (set with config.patch: after pytest's monkeypatch undoes a setattr on
    # Inductor's config, `config.patch({"cpp.vec_isa_ok": ...})` raises "does not exist", and every later compile)
    with config.patch({"cpp.vec_isa_ok": False}):
        assert vec_isa_patches() == {}
