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
    """Default: the children of the model's largest (by parameter count) `nn.ModuleList`/`nn.Sequential`/
    `nn.ModuleDict` (torchtitan keeps its layers in one) whose children all share one type (transformer blocks),
    plus the large pieces around them (`edge_units`: an LLM's input embedding and output head). No such container:
    the root alone."""
    blocks = _block_container(root)
    if blocks is None:
        return []
    units = [c for c in blocks.children() if any(True for _ in c.parameters())]
    return units + edge_units(root, blocks)


def _block_container(root: nn.Module) -> nn.Module | None:
    best, best_numel = None, 0
    for m in root.modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) or len(m) < 2:
            continue
        if len({type(c) for c in m.children()}) != 1:
            continue
        numel = sum(p.numel() for p in m.parameters())
        if numel > best_numel:
            best, best_numel = m, numel
    return best


def edge_units(root: nn.Module, blocks: nn.Module) -> list[nn.Module]:
    """The modules beside the block container that get units of their own.

    Candidates are the subtrees hanging off the path from the root down to `blocks` (an LLM's embedding, final
    norm, output head; a Hugging Face model's `model.embed_tokens` and `lm_head` alike) that hold a parameter of
    two or more dimensions: vector-only modules (norms) are too small for a collective of their own and stay in
    the root. Left in the root, two such pieces are gathered together and both stay alive from the first use to
    the last (embedding in the first layer, head in the last: the whole forward and the whole backward). So when
    there are two or more pieces, each gets a unit; a single one stays in the root, which then gathers it alone.

    A weight shared between candidates (a tied embedding and head) or with the blocks makes one piece that no
    module below the root contains: its parameters go to the root anyway (a parameter belongs to the lowest unit
    containing all its uses), so those candidates get no unit and the tied weight is gathered once per pass.
    """
    on_path = _ancestors_of(root, blocks)
    if on_path is None:
        return []
    candidates = [
        child
        for ancestor in on_path
        for child in ancestor.children()
        if child is not blocks and child not in on_path and any(p.dim() >= 2 for p in child.parameters())
    ]
    first_user: dict[int, int] = {}  # parameter id -> index of the first candidate using it (-1: the blocks)
    shared: set[int] = set()
    for index, module in [(-1, blocks), *enumerate(candidates)]:
        for p in module.parameters():
            if first_user.setdefault(id(p), index) != index:
                shared.add(id(p))
    tied = [any(id(p) in shared for p in c.parameters()) for c in candidates]
    separate = [c for c, is_tied in zip(candidates, tied) if not is_tied]
    pieces = len(separate) + any(tied)  # tied candidates: one piece, in the root
    return separate if pieces >= 2 else []


def _ancestors_of(root: nn.Module, target: nn.Module) -> list[nn.Module] | None:
    """The modules from `root` down to `target`'s parent, or None if `target` is not below `root`."""
    for child in root.children():
        if child is target:
            return [root]
        below = _ancestors_of(child, target)
        if below is not None:
            return [root, *below]
    return None


def check_group(names: list[str]) -> None:
    """A unit of several modules (FQNs `names`) must not list a module and one inside it."""
    for a in names:
        for b in names:
            if a != b and b.startswith(f"{a}." if a else ""):
                raise ValueError(f"fully_shard: a unit of several modules lists '{b}' inside '{a}'; list '{a}' only.")
