"""torch.compile's own `mode=` and `options=` reach Inductor through fsdp_backend (fake PG, world 4)."""

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._dynamo.exc import BackendCompilerFailed

import fsdp_graph
import passes
from fsdp_graph.compiler import backend as backend_module
from tests.graphs.capture import TwoBlock


class _SeenError(Exception):
    """Stops a compile once the lowering pass has recorded the config (no Inductor codegen: fast)."""


def _spy_config(monkeypatch, names: tuple[str, ...], stop: bool) -> list[dict]:
    """Records the Inductor config values `names` as our lowering pass sees them, for every lowered graph."""
    seen: list[dict] = []
    lower = passes.lower_fsdp_ops

    def spy(gm):
        seen.append({name: getattr(inductor_config, name) for name in names})
        if stop:
            raise _SeenError
        return lower(gm)

    monkeypatch.setattr(passes, "lower_fsdp_ops", spy)
    return seen


def _compiled(backend, **compile_kwargs):
    torch._dynamo.reset()
    torch.manual_seed(0)
    # without shared block bodies (the default since issue 25): this checks each block's own nodes
    model = fsdp_graph.fully_shard(TwoBlock(), reuse_blocks=False)
    return torch.compile(model, backend=backend, fullgraph=True, **compile_kwargs)


def test_mode_is_active_while_inductor_compiles(fake_pg, monkeypatch):
    seen = _spy_config(monkeypatch, ("max_autotune", "coordinate_descent_tuning"), stop=True)
    with pytest.raises(BackendCompilerFailed) as raised:
        _compiled(fsdp_graph.make_backend(), mode="max-autotune-no-cudagraphs")(torch.randn(2, 4))
    assert isinstance(raised.value.inner_exception, _SeenError)
    assert seen == [{"max_autotune": True, "coordinate_descent_tuning": True}]
    assert not inductor_config.max_autotune  # a patch, not a global change


@pytest.mark.slow
def test_options_reach_inductor_and_the_model_trains(fake_pg, monkeypatch):
    seen = _spy_config(monkeypatch, ("epilogue_fusion", "fallback_random"), stop=False)
    options = {"epilogue_fusion": False, "fallback_random": True}
    model = _compiled(fsdp_graph.make_backend(), options=options)
    out = model(torch.randn(2, 4))
    out.sum().backward()
    assert seen == [{"epilogue_fusion": False, "fallback_random": True}] * 2  # forward and backward
    assert options == {"epilogue_fusion": False, "fallback_random": True}  # the caller's dict is left alone


def test_options_are_part_of_the_cache_key(fake_pg, monkeypatch):
    uuids = []
    monkeypatch.setattr(
        backend_module, "_compile_eager", lambda gm, inputs, reshard, lower, *rest: uuids.append(lower.uuid())
    )

    def compile_with(options):
        monkeypatch.setattr(
            backend_module, "_compile_inductor", lambda gm, inputs, reshard, lower, *rest: uuids.append(lower.uuid())
        )
        # None is not a callable compiled graph: stop here (unchecked and uncached: the collective check would wrap
        # the None, and a compile that leaves no reports, as a cache hit, compiles again to find them)
        with pytest.raises(BackendCompilerFailed), inductor_config.patch(force_disable_caches=True):
            _compiled(fsdp_graph.make_backend(verify_collectives=False), **options)(torch.randn(2, 4))

    compile_with({})
    compile_with({"options": {"epilogue_fusion": False}})
    compile_with({"options": {"epilogue_fusion": True}})
    compile_with({"mode": "max-autotune-no-cudagraphs"})
    compile_with({"options": {"epilogue_fusion": False}})
    assert len(set(uuids[:4])) == 4 and uuids[4] == uuids[1]


@pytest.mark.parametrize(
    "kwargs, source",
    [
        ({"mode": "reduce-overhead"}, "mode='reduce-overhead' turns them on"),
        ({"mode": "max-autotune"}, "mode='max-autotune' turns them on"),
        ({"options": {"triton.cudagraphs": True}}, r"options\['triton.cudagraphs'\]=True"),
    ],
)
def test_cuda_graphs_are_refused_with_the_reason(fake_pg, kwargs, source):
    with pytest.raises(BackendCompilerFailed, match=f"cannot run its graphs as CUDA graphs \\({source}\\)") as raised:
        _compiled(fsdp_graph.make_backend(), **kwargs)(torch.randn(2, 4))
    message = str(raised.value)
    assert "accumulated in place" in message and "mode='max-autotune-no-cudagraphs'" in message


@pytest.mark.parametrize("kwargs", [{"options": {"epilogue_fusion": False}}, {"mode": "max-autotune-no-cudagraphs"}])
def test_eager_kernels_refuse_inductor_settings(fake_pg, kwargs):
    with pytest.raises(BackendCompilerFailed, match=r"make_backend\(inductor=False\) and runs eager kernels"):
        _compiled(fsdp_graph.make_backend(inductor=False), **kwargs)(torch.randn(2, 4))


def test_bad_options_name_the_entry(fake_pg):
    with pytest.raises(BackendCompilerFailed, match=r"options\['no_such_thing'\] is not an Inductor config entry"):
        _compiled(fsdp_graph.make_backend(), options={"no_such_thing": 1})(torch.randn(2, 4))
    with pytest.raises(BackendCompilerFailed, match=r"options\['post_grad_custom_pre_pass'\] is where fsdp_backend"):
        _compiled(fsdp_graph.make_backend(), options={"post_grad_custom_pre_pass": None})(torch.randn(2, 4))
    with pytest.raises(BackendCompilerFailed, match=r"options\['reorder_for_peak_memory'\] stays False"):
        _compiled(fsdp_graph.make_backend(), options={"reorder_for_peak_memory": True})(torch.randn(2, 4))
    with pytest.raises(BackendCompilerFailed, match="Unrecognized mode=fastest"):
        _compiled(fsdp_graph.make_backend(), mode="fastest")(torch.randn(2, 4))
