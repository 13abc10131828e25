"""The cyclic garbage collector is paused while a sharded model compiles (`fsdp_graph.compiler.gc_pause`)."""

import gc

import pytest
import torch
import torch.nn as nn

import fsdp_graph
from fsdp_graph.compiler import gc_pause


def _model() -> nn.Module:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    return fsdp_graph.fully_shard(model, wrap=[model[0], model[2]])


def test_the_collector_is_paused_while_compiling_and_restored_after(fake_pg, monkeypatch):
    from torch._dynamo.callback import callback_handler

    model, x = _model(), torch.randn(2, 8)
    backend, seen, inside = fsdp_graph.make_backend(inductor=False), [], []
    compile_graph = backend._compile

    def record_inside(*args):
        inside.append(gc.isenabled())
        return compile_graph(*args)

    monkeypatch.setattr(backend, "_compile", record_inside)

    def spy(gm, example_inputs):
        seen.append(gc.isenabled())
        return backend(gm, example_inputs)

    torch._dynamo.reset()
    fsdp_graph.fully_shard(nn.Linear(2, 2))  # sharding installs the pause for the compiles that follow
    assert gc.isenabled()
    collections = []

    def record_collection(phase, info):
        if phase == "start":
            collections.append((info["generation"], gc.isenabled(), len(seen)))

    gc.callbacks.append(record_collection)
    try:
        torch.compile(model, backend=spy)(x).sum().backward()
    finally:
        gc.callbacks.remove(record_collection)
    assert seen == [False] and gc.isenabled()
    # the compile's young objects are collected once, at its end, before the collector is on again
    assert (1, False, 1) in collections, collections

    def broken(gm, example_inputs):
        seen.append(gc.isenabled())
        raise RuntimeError("a backend that fails")

    torch._dynamo.reset()
    gc_pause.install()  # as fully_shard does (reset cleared the callbacks)
    with pytest.raises(Exception, match="a backend that fails"):
        torch.compile(model, backend=broken)(x)
    assert seen[-1] is False and gc.isenabled()  # the end callback runs when the compile raises

    torch._dynamo.reset()
    gc.disable()  # a collector the user turned off stays off
    try:
        torch.compile(model, backend=spy)(x)
        assert seen[-1] is False and not gc.isenabled()
    finally:
        gc.enable()

    # torch._dynamo.reset() clears Dynamo's callbacks: the backend still runs paused, and registers them again
    torch._dynamo.reset()
    assert gc_pause._pause not in callback_handler.start_callbacks
    torch.compile(model, backend=spy)(x)
    assert seen[-1] is True and inside[-1] is False  # this Dynamo trace ran unpaused, our backend paused
    assert gc.isenabled() and gc_pause._pause in callback_handler.start_callbacks
    states = []
    record = callback_handler.register_start_callback(lambda _: states.append(gc.isenabled()))  # runs after ours
    try:
        torch.compile(model, backend=spy)(torch.randn(3, 8))  # a recompile: its Dynamo trace starts paused
    finally:
        callback_handler.remove_start_callback(record)
    assert states == [False] and seen[-1] is False and gc.isenabled()
