"""The eager forward prefetches (issue 27, item 5): on the fake process group, after the first forward recorded the
order, each unit's all-gather is issued before the previous unit's gather is waited for."""

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_graph


class _CollectiveOrder(TorchDispatchMode):
    """The functional all-gathers and waits in issue order, as ("gather", n) / ("wait", n), n counting gathers."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, int]] = []
        self._gathered: list[torch.Tensor] = []  # held, so that a freed gather's id() is not reused for the next

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops._c10d_functional.all_gather_into_tensor.default:
            self.events.append(("gather", len(self._gathered)))
            self._gathered.append(out)
        elif func is torch.ops._c10d_functional.wait_tensor.default:
            n = next((n for n, t in enumerate(self._gathered) if t is args[0]), None)
            if n is not None:
                self.events.append(("wait", n))
        return out


def test_eager_forward_issues_the_next_gather_before_waiting(fake_pg):
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
    fsdp_graph.fully_shard(model, wrap=list(model))
    x = torch.randn(2, 8)
    model(x).sum().backward()  # the first forward gathers one at a time and records the order
    order = _CollectiveOrder()
    with order:
        model(x).sum().backward()
    assert ("wait", 3) in order.events, order.events  # the op gathered (and waited) out of sight
    forward = order.events[: order.events.index(("wait", 3)) + 1]
    # unit k + 1's gather is issued before unit k's wait; the last has no next
    assert forward == [
        ("gather", 0), ("gather", 1), ("wait", 0),
        ("gather", 2), ("wait", 1),
        ("gather", 3), ("wait", 2),
        ("wait", 3),
    ], order.events  # fmt: skip
    root = model._fsdp_root
    assert root.prefetch.order == [s.name for s in root.flat_params] and not root.prefetch.issued
    alone = _CollectiveOrder()
    with alone:
        model[0](x)  # unit 1's gather goes out as predicted; the forward ends without it: waited for, dropped
    assert alone.events == [("gather", 0), ("gather", 1), ("wait", 0), ("wait", 1)], alone.events
    assert not root.prefetch.issued
