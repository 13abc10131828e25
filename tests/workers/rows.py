"""Rank-side workers for the rows layout (issue 13 item 1): optimizers see `Shard(0)` row blocks."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

import fsdp_graph
from fsdp_graph.planning.measure import executed_collectives

VOCAB, DIM, HIDDEN, STEPS = 7, 6, 5, 4


class RowsBlock(nn.Module):
    """fc1: 5 rows (uneven over 2 ranks); gate: 1 row, so the second rank holds none of it or of its bias."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.gate = nn.Linear(DIM, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(torch.relu(self.fc1(h))) * torch.sigmoid(self.gate(h))


class RowsModel(nn.Module):
    """A tied embedding/head of 7 rows, two blocks (the units) and a norm's weight vector."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(RowsBlock() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """Weight decay on matrices only, chosen by `p.ndim` as training scripts do (meaningless on 1-D flat slices)."""
    params = list(model.parameters())
    return torch.optim.SGD(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=0.1,
        momentum=0.9,
    )


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (rows, 5), generator=g)
    return tokens, torch.randint(0, VOCAB, (rows, 5), generator=g)


def _step(model, optimizer, tokens, targets) -> float:
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def reference(world: int) -> dict:
    """Single-process training on the whole batch: the parameters and momentum buffers after STEPS steps."""
    torch.manual_seed(0)
    model = RowsModel()
    optimizer = _optimizer(model)
    for step in range(STEPS):
        _step(model, optimizer, *_batch(step, 2 * world))
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "momentum": {names[id(p)]: s["momentum_buffer"].clone() for p, s in optimizer.state.items()},
        "groups": [len(g["params"]) for g in optimizer.param_groups],
    }


def train_rows(rank: int, world: int, mode: str, layout: str | None = None) -> dict:
    """STEPS steps of the sharded model (`mode`: "eager", "compiled" with eager kernels, or "bucketed": compiled
    with every unit's gathers and reductions in one bucket each way, whose copy-out feeds the rows copy-out); what
    the optimizer saw, the state dict's shape and values, and what `model.state_dict()` communicated. `layout`:
    None is fully_shard's default (rows)."""
    torch.manual_seed(0)
    model = fsdp_graph.fully_shard(RowsModel(), **({} if layout is None else {"layout": layout}))
    shapes = {n: (tuple(p.shape), p.ndim) for n, p in model.named_parameters()}
    optimizer = _optimizer(model)
    run = model
    if mode in ("compiled", "bucketed"):  # bucketed: the three units' collectives merged into one each way
        torch._dynamo.reset()
        backend = fsdp_graph.make_backend(inductor=False, bucket_bytes=1 << 20 if mode == "bucketed" else 0)
        run = torch.compile(model, backend=backend, fullgraph=True)
    for step in range(STEPS):
        tokens, targets = _batch(step, 2 * world)
        _step(run, optimizer, tokens.chunk(world)[rank], targets.chunk(world)[rank])

    collectives = executed_collectives(model.state_dict)
    sd = model.state_dict()
    placements = {k: tuple(v.placements) for k, v in sd.items() if isinstance(v, DTensor)}
    full = {k: v.full_tensor().clone() for k, v in sd.items()}
    optim_sd = fsdp_graph.optim_state_dict(model, optimizer)
    momentum = {fqn: s["momentum_buffer"].full_tensor().clone() for fqn, s in optim_sd["state"].items()}

    # Round trip: the DTensors (copied: with rows they alias the parameters), then full tensors.
    saved = {k: _copy(v) for k, v in sd.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(saved)
    after_dtensor_load = {k: v.full_tensor() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(copy.deepcopy(full))
    after_full_load = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return {
        "shapes": shapes,
        "groups": [len(g["params"]) for g in optimizer.param_groups],
        "placements": placements,
        "full_shapes": {k: tuple(v.shape) for k, v in sd.items()},
        "params": full,
        "momentum": momentum,
        "state_dict_gathers": collectives.counts["all_gather"] + _gloo_gathers(collectives.backend_counts),
        "round_trip": max(_max_diff(full, after_dtensor_load), _max_diff(full, after_full_load)),
        "is_shard0": all(p == (Shard(0),) for p in placements.values()),
    }


def _copy(value: torch.Tensor) -> torch.Tensor:
    if not isinstance(value, DTensor):
        return value.clone()
    return DTensor.from_local(
        value.to_local().clone(),
        value.device_mesh,
        value.placements,
        run_check=False,
        shape=value.shape,
        stride=value.stride(),
    )


def _gloo_gathers(backend_counts) -> int:
    return sum(n for name, n in backend_counts.items() if "gather" in name)


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def state_traffic(rank: int, world: int, path: str, layout: str) -> dict:
    """Bytes each rank sends in collectives while it takes `model.state_dict()`, `optim_state_dict`, and a DCP
    `save_checkpoint` + `load_checkpoint` of a 6.4 M-parameter GPT (SGD with momentum), against the model's bytes.
    Counted from the process-group backend's own events (gloo: every collective, DCP's object collectives and
    barriers included) plus any functional collective; and whether the loaded state equals the saved one."""
    from fsdp_graph.train.gpt import GPT, GPTConfig, gpt_loss

    torch.manual_seed(0)
    model = fsdp_graph.fully_shard(GPT(GPTConfig(vocab=255, dim=512, heads=4, layers=2, seq=16)), layout=layout)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tokens = torch.randint(0, 255, (2, 16), generator=torch.Generator().manual_seed(rank))
    gpt_loss(model, (tokens, tokens)).backward()
    optimizer.step()
    optimizer.zero_grad()
    model_bytes = sum(v.numel() * v.element_size() for v in fsdp_graph.full_state_dict(model).values())
    before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    before_optim = {
        fqn: s["momentum_buffer"].full_tensor().clone()
        for fqn, s in fsdp_graph.optim_state_dict(model, optimizer)["state"].items()
    }

    def sent(fn) -> float:
        counted = executed_collectives(fn)
        return counted.total_wire_bytes + sum(counted.backend_wire_bytes.values())

    out = {
        "model_bytes": model_bytes,
        "state_dict": sent(model.state_dict),
        "optim_state_dict": sent(lambda: fsdp_graph.optim_state_dict(model, optimizer)),
        "save": sent(lambda: fsdp_graph.save_checkpoint(path, model, optimizer)),
    }
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    for s in optimizer.state.values():
        s["momentum_buffer"].zero_()
    out["load"] = sent(lambda: fsdp_graph.load_checkpoint(path, model, optimizer))
    after = {k: v.full_tensor() for k, v in model.state_dict().items()}
    after_optim = {
        fqn: s["momentum_buffer"].full_tensor()
        for fqn, s in fsdp_graph.optim_state_dict(model, optimizer)["state"].items()
    }
    out["round_trip"] = max(_max_diff(before, after), _max_diff(before_optim, after_optim))
    return out
