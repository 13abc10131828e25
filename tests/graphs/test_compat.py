"""fsdp_graph.compat: what differs between torch 2.11 and 2.13, taken from the feature itself. Each test runs the
branch of the installed torch and, by replacing the feature with its torch 2.11 shape, the other one."""

import dataclasses
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fsdp_graph import compat
from fsdp_graph.state.checksums import files_written

pytestmark = pytest.mark.oldest_torch


@pytest.fixture
def fresh_notes(monkeypatch):
    """compat's once-per-process state, emptied for the test and restored after it."""
    monkeypatch.setattr(compat, "_NOTED", set())
    compat.has_reuse_hash_fn.cache_clear()
    yield
    compat.has_reuse_hash_fn.cache_clear()


def _notes(action) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
    return [str(w.message) for w in caught if issubclass(w.category, compat.TorchFeatureWarning)]


def test_region_without_reuse_hash_fn_is_made_without_it_and_said_once(fresh_notes, monkeypatch):
    """torch 2.11's nested_compile_region(fn=None, options=None) has no `reuse_hash_fn`: the region is made without
    it, and making units share a body says so once per process."""
    made = []

    def region_211(fn=None, options=None):
        made.append(fn)
        return fn

    def body(x):
        return x

    monkeypatch.setattr(torch.compiler, "nested_compile_region", region_211)
    assert not compat.has_reuse_hash_fn()
    assert compat.nested_compile_region(body, reuse_hash_fn=lambda *a: 0) is body and made == [body]
    notes = _notes(lambda: [compat.note_shared_bodies() for _ in range(3)])
    assert len(notes) == 1 and "has no torch.compiler.nested_compile_region(reuse_hash_fn=)" in notes[0], notes
    assert "Dynamo traces the body again at every block" in notes[0]


def test_region_with_reuse_hash_fn_passes_it_and_says_nothing(fresh_notes, monkeypatch):
    given = {}

    def region_213(fn=None, *, options=None, max_reuse_entries=8, reuse_hash_fn=None):
        given.update(fn=fn, reuse_hash_fn=reuse_hash_fn)
        return fn

    def key(*args):
        return 0

    monkeypatch.setattr(torch.compiler, "nested_compile_region", region_213)
    assert compat.has_reuse_hash_fn()
    compat.nested_compile_region(len, reuse_hash_fn=key)
    assert given == {"fn": len, "reuse_hash_fn": key}
    assert _notes(compat.note_shared_bodies) == []


def test_the_installed_torch_is_probed_by_its_signature(fresh_notes):
    import inspect

    expected = "reuse_hash_fn" in inspect.signature(torch.compiler.nested_compile_region).parameters
    assert compat.has_reuse_hash_fn() is expected


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, no group: what this test means
def test_files_written_by_dcp_save_with_and_without_storage_data(tmp_path):
    """torch 2.13's dcp.save returns Metadata with `storage_data`; torch 2.11's FileSystemWriter fills a copy and
    returns it without (None): the files are then read from the `.metadata` file it wrote."""
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
    metadata = dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    on_disk = dcp.FileSystemReader(str(tmp_path)).read_metadata().storage_data
    written = sorted(p.name for p in tmp_path.iterdir())
    assert any(name.endswith(".distcp") for name in written) and ".metadata" in written, written
    as_211 = dataclasses.replace(metadata, storage_data=None)
    for returned in (metadata, as_211):
        assert compat.saved_storage_data(returned, str(tmp_path)) == on_disk
        assert files_written(returned, str(tmp_path)) == written


def test_all_gather_single_under_either_name(monkeypatch):
    """torch 2.13's `dist.all_gather_single`, else (torch 2.11, 2.12) `all_gather_into_tensor`: same result."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for old_name_only in (False, True):
            if old_name_only:
                monkeypatch.delattr(dist, "all_gather_single", raising=False)
            out = torch.zeros(3)
            compat.all_gather_single(out, torch.arange(3.0))
            assert out.tolist() == [0.0, 1.0, 2.0], old_name_only
    finally:
        dist.destroy_process_group()


def test_units_with_buffers_keep_their_own_body_without_reuse_hash_fn(monkeypatch):
    """torch 2.11's invoke_subgraph cannot train a shared body that writes a buffer, and whether a forward writes one
    is known only once traced: there, a unit holding a buffer is traced on its own (the reason names the buffer);
    a unit without buffers still shares; torch 2.13 refuses neither."""
    from fsdp_graph.runtime.block_region import buffer_refusals

    with_buffer, plain = torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 4)
    units = {"layers.0": with_buffer, "layers.1": plain}
    monkeypatch.setattr(compat, "has_reuse_hash_fn", lambda: False)
    refused = buffer_refusals(units)
    assert list(refused) == ["layers.0"] and "'running_mean'" in refused["layers.0"], refused
    monkeypatch.setattr(compat, "has_reuse_hash_fn", lambda: True)
    assert buffer_refusals(units) == {}
