"""Re-created (written here) from torch's test_fully_shard_training.py, issue 32: each function is named after the
upstream test it re-creates and returns a dict of floats (1.0: an assertion held; *_diff: largest difference).
Upstream's models (torch's test Transformer and MLP), calling conventions and assertions; SGD with momentum where
upstream uses Adam (the project's rule), fewer steps where noted; private FSDP2 state replaced by public means."""

from __future__ import annotations

import copy
import gc

import torch
import torch.nn as nn
from torch.distributed._composable import checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.tensor import DTensor, Shard

from tests.workers.upstream_common import (
    all_dtensors,
    blocks_of,
    ddp_parity,
    full,
    fully_shard,
    impl,
    loss_diff,
    mlp,
    no_dtensors,
    raises,
    sharded_diff,
    transformer,
)


def root_move_forward_input(rank: int, world: int) -> dict[str, float]:
    """test_root_move_forward_input_to_device: a parameter-less root takes nested inputs (CPU: no device move)."""

    class ParamlessModule(nn.Module):
        def forward(self, x, ys):
            return x + ys[0] + ys[1] + 1

    model = ParamlessModule()
    fully_shard(model)
    x, ys = torch.randn(3), (torch.randn(3), torch.randn(3))
    return {"out_diff": (model(x, ys) - (x + ys[0] + ys[1] + 1)).abs().max().item()}


def _same_params(params, ref_params) -> float:
    params, ref_params = list(params), list(ref_params)
    return float(
        len(params) == len(ref_params)
        and all(
            torch.equal(p.full_tensor() if isinstance(p, DTensor) else p.detach(), r.detach())
            for p, r in zip(params, ref_params)
        )
    )


def param_registration_after_forward(rank: int, world: int) -> dict[str, float]:
    """test_param_registration_after_forward: after a forward, FSDP2 registers the unsharded plain tensors where it
    does not reshard (reshard_after_forward False; None: the root's) and DTensors where it does; reshard() restores
    the DTensors."""
    out: dict[str, float] = {}
    inp = torch.randn(2, 3)
    for raf in (True, False, 2, None):
        torch.manual_seed(42)
        model = mlp(3)
        ref = copy.deepcopy(model)
        fully_shard(model, reshard_after_forward=raf)
        out[f"single_{raf}_before"] = all_dtensors(model.parameters()) * _same_params(model.parameters(), ref.parameters())
        model(inp)
        kept = all_dtensors(model.parameters()) if raf else no_dtensors(model.parameters())
        out[f"single_{raf}_after"] = kept * _same_params(model.parameters(), ref.parameters())
        model.reshard()
        out[f"single_{raf}_resharded"] = all_dtensors(model.parameters())
    for raf in (True, False, 2, None):
        torch.manual_seed(42)
        model = nn.Sequential(mlp(3), mlp(3))
        ref = copy.deepcopy(model)
        fully_shard(model[0].in_proj, reshard_after_forward=raf)
        fully_shard(model[0].out_proj, reshard_after_forward=raf)
        fully_shard(model, reshard_after_forward=raf)
        out[f"multi_{raf}_before"] = all_dtensors(model.parameters())
        model(inp)
        non_root = list(model[0].in_proj.parameters()) + list(model[0].out_proj.parameters())
        root = [p for p in model.parameters() if all(p is not q for q in non_root)]
        if raf is None:
            kept = all_dtensors(non_root) * no_dtensors(root)
        elif raf:
            kept = all_dtensors(non_root) * all_dtensors(root)
        else:
            kept = no_dtensors(non_root) * no_dtensors(root)
        out[f"multi_{raf}_after"] = kept * _same_params(model.parameters(), ref.parameters())
        for module in model.modules():
            if isinstance(module, impl().FSDPModule):
                module.reshard()
        out[f"multi_{raf}_resharded"] = all_dtensors(model.parameters())
    return out


def param_registration_after_backward(rank: int, world: int) -> dict[str, float]:
    """test_param_registration_after_backward: DTensors after a backward, one group and three, reshard T/F/2."""
    out: dict[str, float] = {}
    inp = torch.randn(2, 8)
    for raf in (True, False, 2):
        model = mlp(8)
        fully_shard(model, reshard_after_forward=raf)
        model(inp).sum().backward()
        out[f"single_{raf}"] = all_dtensors(model.parameters())
        model = mlp(8)
        for module in (model.in_proj, model.out_proj, model):
            fully_shard(module, reshard_after_forward=raf)
        model(inp).sum().backward()
        out[f"multi_{raf}"] = all_dtensors(model.parameters())
    return out


def _merge(out: dict[str, float], tag: str, result: dict[str, float]) -> None:
    out.update({f"{k}_{tag}": v for k, v in result.items()})


def train_parity_single_group(rank: int, world: int, mode: str, largest_dim: bool = False) -> dict[str, float]:
    """test_train_parity_single_group_shard_dim0 (three shapes) and ..._shard_largest_dim: 10 steps vs DDP."""
    out: dict[str, float] = {}
    shapes = [((32, 16), (16, 8))] if largest_dim else [((16, 15), (15, 8)), ((7, 15), (15, 3)), ((16, 17), (17, 8))]
    placement = (lambda p: Shard(p.shape.index(max(p.shape)))) if largest_dim else None
    for i, (a, b) in enumerate(shapes):

        def build(a=a, b=b):
            return nn.Sequential(nn.Linear(*a), nn.ReLU(), nn.Linear(*b))

        x = torch.randn(4, a[0])
        _merge(out, str(i), ddp_parity(build, lambda m: fully_shard(m, shard_placement_fn=placement), lambda s, x=x: x, mode, 10, rank))
    return out


def train_parity_shard_largest_dim(rank: int, world: int, mode: str) -> dict[str, float]:
    return train_parity_single_group(rank, world, mode, largest_dim=True)


def _shard_transformer(model: nn.Module, **options) -> None:
    for block in blocks_of(model):
        fully_shard(block, **options)
    fully_shard(model, **options)


def train_parity_multi_group(rank: int, world: int, mode: str) -> dict[str, float]:
    """test_train_parity_multi_group (reshard True/False/2, compiled: True; no delays: they are CUDA sleeps), 5 of
    10 steps."""
    out: dict[str, float] = {}
    for raf in (True, False, 2) if mode == "eager" else (True,):

        def build():
            return transformer(n_layers=3, n_heads=4, vocab_size=1024, max_seq_len=64, dropout_p=0)[0]

        inputs = [torch.randint(0, 1024, (3, 64)) for _ in range(5)]
        result = ddp_parity(build, lambda m, r=raf: _shard_transformer(m, reshard_after_forward=r), lambda s, inputs=inputs: inputs[s], mode, 5, rank)
        _merge(out, str(raf), result)
    return out


def train_parity_unshard_async_op(rank: int, world: int) -> dict[str, float]:
    """test_train_parity_multi_group_unshard_async_op: `_set_unshard_async_op(True)` (fsdp_graph: a no-op)."""

    def shard(model):
        _shard_transformer(model)
        model._set_unshard_async_op(True)

    inputs = [torch.randint(0, 1024, (3, 64)) for _ in range(5)]

    def build():
        return transformer(n_layers=3, n_heads=4, vocab_size=1024, max_seq_len=64, dropout_p=0)[0]

    return ddp_parity(build, shard, lambda s, inputs=inputs: inputs[s], "eager", 5, rank)


def non_root_forward_backward(rank: int, world: int) -> dict[str, float]:
    """test_non_root_forward_backward: root forward/backward/step, then model[0]'s own; losses and a last forward."""
    torch.manual_seed(42)
    model = nn.Sequential(*(mlp(32) for _ in range(3)))
    ref = copy.deepcopy(model)
    for m in model:
        fully_shard(m)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
    torch.manual_seed(42 + rank)
    inp = torch.randn(8, 32)
    ref_root = ref(inp).sum()
    ref_root.backward()
    from tests.workers.upstream_common import average_grads

    average_grads(ref)
    ref_opt.step()
    ref_opt.zero_grad()
    ref_nonroot = ref[0](inp).sum()
    ref_nonroot.backward()
    average_grads(ref)
    ref_opt.step()
    root = model(inp).sum()
    root.backward()
    opt.step()
    opt.zero_grad()
    nonroot = model[0](inp).sum()
    nonroot.backward()
    opt.step()
    return {
        "root_loss_diff": loss_diff(ref_root, root),
        "nonroot_loss_diff": loss_diff(ref_nonroot, nonroot),
        "final_diff": loss_diff(ref(inp).sum(), model(inp).sum()),
    }


class MultiForwardModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 5)

    def forward(self, x):
        return self.outer(self.inner(x) + self.inner(x))


def multi_forward_module(rank: int, world: int, mode: str) -> dict[str, float]:
    """test_multi_forward_module: `inner` called twice per forward; reshard True/False/2 (upstream passes it to no
    call, so each variant is the default), 10 steps."""
    inp = None

    def shard(model):
        fully_shard(model.inner)
        fully_shard(model)

    torch.manual_seed(42 + rank)
    inp = torch.randn(32, 4)
    return ddp_parity(MultiForwardModule, shard, lambda s, inp=inp: inp, mode, 10, rank)


def explicit_prefetching(rank: int, world: int) -> dict[str, float]:
    """test_explicit_prefetching: Transformer(8 layers), two layers ahead each way, 5 of 10 steps (fsdp_graph:
    no-ops)."""

    def build():
        return transformer(n_layers=8, dropout_p=0.0)[0]

    def shard(model):
        for layer in [*model.layers, model]:
            fully_shard(layer)
        layers = list(model.layers)
        for i, layer in enumerate(layers[:-2]):
            layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 3])
        for i, layer in enumerate(layers):
            if i >= 2:
                layer.set_modules_to_backward_prefetch([layers[i - 1], layers[i - 2]])

    torch.manual_seed(42 + rank)
    inp = torch.randint(0, 8, (2, 8))
    return ddp_parity(build, shard, lambda s, inp=inp: inp, "eager", 5, rank, set_to_none=lambda s: True)


def _ac_shard(model, args, grouping: str, raf) -> None:
    if grouping == "mem_eff":
        fully_shard(model.layers[0], reshard_after_forward=raf)
        fully_shard([model.layers[1], model.layers[2]], reshard_after_forward=raf)
        fully_shard([model.tok_embeddings, model.pos_embeddings], reshard_after_forward=raf)
        model.tok_embeddings.set_unshard_in_backward(False)
        fully_shard([model.norm, model.output], reshard_after_forward=raf)
    elif grouping == "mem_eff_weight_tied":
        fully_shard([model.tok_embeddings, model.output], reshard_after_forward=raf)
        for layer in model.layers:
            fully_shard(layer, reshard_after_forward=raf)
    else:
        for layer in model.layers:
            fully_shard(layer, reshard_after_forward=raf)
    fully_shard(model, reshard_after_forward=raf)


def train_parity_with_activation_checkpointing(rank: int, world: int, mode: str) -> dict[str, float]:
    """test_train_parity_with_activation_checkpointing: reshard T/F x checkpoint composable/utils/wrapper x grouping
    block/mem_eff/mem_eff_weight_tied (eager: all pairs of the three, 9 cases), 3 of 10 steps (compiled: upstream skips composable; utils with block and
    wrapper with mem_eff, reshard True: each compile costs seconds); sharded parameter and gradient parity after
    each step."""
    out: dict[str, float] = {}
    impls, groupings = ("composable", "utils", "wrapper"), ("block", "mem_eff", "mem_eff_weight_tied")
    # eager: every checkpoint implementation with every grouping, reshard_after_forward alternating so that each
    # value meets every implementation and every grouping (all pairs of the three factors, 9 of the 18 cases)
    cases = [(True, "utils", "block"), (True, "wrapper", "mem_eff")] if mode == "compiled" else [
        ((i + g) % 2 == 0, impl, grouping) for i, impl in enumerate(impls) for g, grouping in enumerate(groupings)
    ]
    for raf, impl_name, grouping in cases:

        def build(impl_name=impl_name, grouping=grouping):
            return transformer(
                n_layers=3, n_heads=4, vocab_size=1024, max_seq_len=64, dropout_p=0,
                checkpoint_activations=impl_name == "utils", weight_tying=grouping != "mem_eff",
            )[0]

        def shard(model, impl_name=impl_name, grouping=grouping, raf=raf):
            if impl_name == "wrapper":
                apply_activation_checkpointing(model, check_fn=lambda m: m in blocks_of(model))
            elif impl_name == "composable":
                for block in blocks_of(model):
                    checkpoint(block)
            _ac_shard(model, None, grouping, raf)

        torch.manual_seed(42 + rank)
        inp = torch.randint(0, 1024, (3, 64))
        _merge(out, f"{raf}_{impl_name}_{grouping}", ddp_parity(build, shard, lambda s, inp=inp: inp, mode, 3, rank))
    return out


def train_shared_params(rank: int, world: int, mode: str) -> dict[str, float]:
    """test_train_parity_with_shared_params: tied Transformer, blocks sharded (and composable-checkpointed), reshard
    False/True x AC, 5 of 10 steps (compiled: reshard True without composable checkpoint, which upstream's compile
    tests skip)."""
    out: dict[str, float] = {}
    for raf in (False, True) if mode == "eager" else (True,):
        for ac in (False,) if mode == "compiled" else (False, True):

            def shard(model, raf=raf, ac=ac):
                for block in blocks_of(model):
                    if ac:
                        checkpoint(block)
                    fully_shard(block, reshard_after_forward=raf)
                fully_shard(model, reshard_after_forward=raf)

            torch.manual_seed(42 + rank + 1)
            inputs = [torch.randint(0, 8, (2, 16)) for _ in range(5)]
            build = lambda: transformer(n_layers=3, dropout_p=0.0, weight_tying=True)[0]  # noqa: E731
            _merge(out, f"{raf}_{ac}", ddp_parity(build, shard, lambda s, inputs=inputs: inputs[s], mode, 5, rank))
    return out


class TiedModel(nn.Module):
    def __init__(self, vocab: int, hidden: int = 16) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, hidden)
        self.output = nn.Linear(hidden, vocab, bias=False)
        self.output.weight = self.tok_embeddings.weight

    def forward(self, ids):
        return self.output(self.tok_embeddings(ids))


def train_shared_params_uneven_shard(rank: int, world: int) -> dict[str, float]:
    """test_train_shared_params_uneven_shard: tied weights in one group, vocab world*4+1 rows; every row trains
    (read between `unshard()` and `reshard()`, whole through `full_tensor()` where it is still a DTensor)."""
    out: dict[str, float] = {}
    vocab = world * 4 + 1
    for raf in (True, False):
        torch.manual_seed(42)
        model = TiedModel(vocab)
        fully_shard([model.tok_embeddings, model.output], reshard_after_forward=raf)
        fully_shard(model, reshard_after_forward=raf)
        model.tok_embeddings.unshard()
        initial = full(model.tok_embeddings.weight).detach().clone()
        model.tok_embeddings.reshard()
        opt = torch.optim.SGD(model.parameters(), lr=1e-1, momentum=0.9)
        torch.manual_seed(42 + rank)
        for _ in range(10):
            ids = torch.randint(0, vocab, (2, 8))
            nn.functional.cross_entropy(model(ids).view(-1, vocab).float(), ids.view(-1)).backward()
            opt.step()
            opt.zero_grad()
        model.tok_embeddings.unshard()
        final = full(model.tok_embeddings.weight).detach().clone()  # FSDP2: the unsharded storage is freed by reshard()
        model.tok_embeddings.reshard()
        out[f"rows_moved_{raf}"] = float(all(not torch.equal(initial[r], final[r]) for r in range(vocab)))
    return out


def shared_params_separate_groups_error(rank: int, world: int) -> dict[str, float]:
    """test_shared_params_separate_fsdp_groups_error: ValueError 'already managed by another' by the first forward."""
    model = TiedModel(17)

    def calls_and_forward():
        fully_shard(model.tok_embeddings)
        fully_shard(model.output)
        fully_shard(model)
        model(torch.randint(0, 17, (2, 8)))

    return {"raised": raises(calls_and_forward, ValueError, "already managed by another")}


def layer_by_layer_shard(rank: int, world: int) -> dict[str, float]:
    """test_layer_by_layer_shard_no_false_positive: blocks sharded one by one with gc between; a step runs."""

    class SimpleBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.linear = nn.LayerNorm(16), nn.Linear(16, 16, bias=False)

        def forward(self, x):
            return self.linear(self.norm(x))

    class LayerByLayer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList()

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    model = LayerByLayer()
    for _ in range(8):
        block = SimpleBlock()
        model.blocks.append(block)
        fully_shard(block)
        gc.collect()
    fully_shard(model)
    model(torch.randn(2, 4, 16)).sum().backward()
    return {"grads": float(all(p.grad is not None for p in model.parameters()))}


def shard_placement_fn_largest_dim(rank: int, world: int) -> dict[str, float]:
    """test_train_parity_shard_placement_fn_shard_largest_dim: Transformer, largest-dim placement; full parameters
    equal the reference's before and after 5 steps (losses each step)."""

    def build():
        return transformer(n_layers=3, dropout_p=0.0)[0]

    def shard(model):
        _shard_transformer(model, shard_placement_fn=lambda p: Shard(p.shape.index(max(p.shape))))

    torch.manual_seed(42 + rank)
    inp = torch.randint(0, 8, (2, 16))
    return ddp_parity(build, shard, lambda s, inp=inp: inp, "eager", 5, rank, set_to_none=lambda s: True)


def shard_placement_fn_contiguous(rank: int, world: int) -> dict[str, float]:
    """test_shard_placement_fn_contiguous_params_grads: Shard(1) for matrices; parameters, local tensors and
    gradients contiguous, also in each forward."""
    model = mlp(4)
    placement = lambda p: Shard(1) if p.ndim > 1 else Shard(0)  # noqa: E731
    for module in (model.in_proj, model.out_proj, model):
        fully_shard(module, shard_placement_fn=placement)
    seen = []
    for sub in (model.in_proj, model.out_proj):
        sub.register_forward_pre_hook(lambda m, a: seen.append(all(p.is_contiguous() for p in m.parameters())))
    out = {"params": float(all(p.is_contiguous() and p.to_local().is_contiguous() for p in model.parameters()))}
    model(torch.randn(2, 4)).sum().backward()
    out["in_forward"] = float(bool(seen) and all(seen))
    out["grads"] = float(all(p.grad.is_contiguous() and p.grad.to_local().is_contiguous() for p in model.parameters()))
    return out


def register_fsdp_forward_method(rank: int, world: int) -> dict[str, float]:
    """test_register_fsdp_forward_method: upstream's ViT whose parent calls `vit.forward_features`."""

    class VisionTransformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.patch_proj = nn.Conv2d(3, 1024, kernel_size=14, stride=14)

        def forward_features(self, imgs):
            return self.patch_proj(imgs).flatten(2).transpose(1, 2)

        def forward(self, imgs):
            return self.forward_features(imgs).sum(dim=1)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vit, self.projector = VisionTransformer(), nn.Linear(1024, 256)

        def forward(self, imgs):
            return self.projector(self.vit.forward_features(imgs))

    torch.manual_seed(42)
    model = Model()
    ref = copy.deepcopy(model)
    for module in (model.vit, model.projector, model):
        fully_shard(module)
    impl().register_fsdp_forward_method(model.vit, "forward_features")
    torch.manual_seed(42 + rank + 1)
    inp = torch.randn(4, 3, 224, 224)
    ref_loss, loss = ref(inp).sum(), model(inp).sum()
    ref_loss.backward()
    loss.backward()
    from tests.workers.upstream_common import average_grads

    average_grads(ref)
    return {"loss_diff": loss_diff(ref_loss, loss), "grad_diff": sharded_diff(ref, model, grads=True)}
