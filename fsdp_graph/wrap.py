"""Wrap policies: which modules become FSDP units (DESIGN §4). The root is always a unit, last."""

from __future__ import annotations

from collections.abc import Iterable

import torch.nn as nn


class ModuleWrapPolicy:
    """Every module that is an instance of one of `module_classes` becomes a unit."""

    def __init__(self, module_classes: Iterable[type[nn.Module]]):
        self.module_classes = tuple(module_classes)
        if not self.module_classes:
            raise ValueError("ModuleWrapPolicy needs at least one module class, e.g. ModuleWrapPolicy({Block})")

    def __call__(self, root: nn.Module) -> list[nn.Module]:
        return [m for m in root.modules() if m is not root and isinstance(m, self.module_classes)]

    def __repr__(self) -> str:
        return f"ModuleWrapPolicy({sorted(c.__name__ for c in self.module_classes)})"


class size_based_wrap_policy:  # noqa: N801  (named like the function FSDP1 users know)
    """FSDP1's size-based policy: a module becomes a unit when the parameters it would own (those not
    already in a unit below it) number at least `min_num_params`."""

    def __init__(self, min_num_params: int = 100_000_000):
        if min_num_params <= 0:
            raise ValueError(f"size_based_wrap_policy needs min_num_params > 0, got {min_num_params}")
        self.min_num_params = min_num_params

    def __call__(self, root: nn.Module) -> list[nn.Module]:
        units: list[nn.Module] = []
        seen: set[int] = set()

        def visit(module: nn.Module) -> int:
            """Returns the numel of parameters under `module` not owned by a unit below it."""
            owned = 0
            for child in module.children():
                owned += visit(child)
            for p in module.parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    owned += p.numel()
            if module is not root and owned >= self.min_num_params:
                units.append(module)
                return 0
            return owned

        visit(root)
        order = {id(m): i for i, m in enumerate(root.modules())}
        return sorted(units, key=lambda m: order[id(m)])

    def __repr__(self) -> str:
        return f"size_based_wrap_policy({self.min_num_params})"


def auto_wrap_policy(root: nn.Module) -> list[nn.Module]:
    """Default: the children of the model's largest (by parameter count) `nn.ModuleList`/`nn.Sequential`
    whose children all share one type (transformer blocks). No such container: the root alone."""
    best, best_numel = None, 0
    for m in root.modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) < 2:
            continue
        if len({type(c) for c in m}) != 1:
            continue
        numel = sum(p.numel() for p in m.parameters())
        if numel > best_numel:
            best, best_numel = m, numel
    return [] if best is None else [c for c in best if any(True for _ in c.parameters())]
