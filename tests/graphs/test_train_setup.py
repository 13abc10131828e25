"""The main job's setup: its process group under torchrun (`cpu:gloo,cuda:nccl` with CUDA, gloo without, LOCAL_RANK's
GPU), and what a newcomer sees while the first step compiles."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from fsdp_graph.runtime import devices
from fsdp_graph.train import job as train


class _StopError(Exception):
    pass


@pytest.mark.parametrize(
    "cuda, env, expected",
    [
        (True, {"LOCAL_RANK": "3"}, ("cpu:gloo,cuda:nccl", 3)),
        (True, {}, ("cpu:gloo,cuda:nccl", 0)),
        (False, {"LOCAL_RANK": "3"}, ("gloo", None)),
    ],
)
def test_process_group_setup(cuda, env, expected):
    assert train.process_group_setup(cuda, env) == expected


def test_process_group_setup_rejects_a_bad_local_rank():
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        train.process_group_setup(True, {"LOCAL_RANK": "gpu0"})


def test_torchrun_rank_makes_a_mixed_group_on_its_local_gpu(monkeypatch):
    calls = []
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))

    def init(backend, **kwargs):
        calls.append(("init", backend))
        raise _StopError

    monkeypatch.setattr(dist, "init_process_group", init)
    with pytest.raises(_StopError):
        train._torchrun_rank(train.parse_args([]))
    assert calls == [("set_device", 3), ("init", "cpu:gloo,cuda:nccl")]


def test_train_rank_computes_on_the_mixed_groups_gpu(monkeypatch, fake_pg):
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(devices, "_current_index", lambda device_type: 3)

    def build(args, world, device, backend):
        raise _StopError(device)

    monkeypatch.setattr(train, "_build", build)
    with pytest.raises(_StopError) as stopped:
        train.train_rank(0, 4, train.parse_args([]))
    assert stopped.value.args == (torch.device("cuda", 3),)


class _RecordingBar:
    def __init__(self):
        self.descriptions: list[str] = []

    def set_description_str(self, text: str, refresh: bool = True) -> None:
        self.descriptions.append(text)


def test_compile_ticker_counts_the_first_steps_seconds_then_says_train():
    bar = _RecordingBar()
    with train.compile_ticker(bar, active=True, every_s=0.05):
        time.sleep(0.3)
    assert any(d.startswith("compiling ") and d.endswith(" s") for d in bar.descriptions), bar.descriptions
    assert bar.descriptions[-1] == "train"
    idle = _RecordingBar()
    with train.compile_ticker(idle, active=False, every_s=0.05):
        time.sleep(0.15)
    assert idle.descriptions == []


def test_header_states_the_expected_compile_wait(capsys, fake_pg):
    args = train.parse_args(["--steps", "3"])
    train._print_header(args, train.preset("tiny"), 2, torch.device("cpu"), 0)
    assert "The first step compiles the model into one graph: expect 30-50 s" in capsys.readouterr().out
    args = train.parse_args(["--backend-mode", "aot"])
    train._print_header(args, train.preset("tiny"), 2, torch.device("cpu"), 0)
    assert "no code generation" in capsys.readouterr().out
    train._print_header(train.parse_args(["--no-compile"]), train.preset("tiny"), 2, torch.device("cpu"), 0)
    assert "compiles" not in capsys.readouterr().out


def test_block_reuse_is_the_default_and_off_with_tp(capsys, fake_pg):
    """Issue 25: the job shares block bodies where eligible unless told otherwise; --tp turns the default off (its
    blocks are tensor-parallel, which fully_shard cannot share a body across), and the header says so."""
    assert train._shard_kwargs(train.parse_args([]))["reuse_blocks"] is None
    assert train._shard_kwargs(train.parse_args(["--reuse-blocks"]))["reuse_blocks"] is True
    assert train._shard_kwargs(train.parse_args(["--no-reuse-blocks"]))["reuse_blocks"] is False
    assert train._shard_kwargs(train.parse_args(["--pp", "2", "--world", "4"]))["reuse_blocks"] is None
    args = train.parse_args(["--tp", "2", "--world", "4"])
    assert train._shard_kwargs(args)["reuse_blocks"] is False
    train._print_header(args, train.preset("tiny"), 4, torch.device("cpu"), 0)
    assert "Block reuse is off with --tp" in capsys.readouterr().out
