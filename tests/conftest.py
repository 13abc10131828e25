import os
import tempfile

# One Inductor cache per test session (spawned ranks inherit it): repeated graphs compile once,
# and nothing leaks in from earlier runs. Each xdist worker gets a directory of its own inside it: two workers' rank
# tests may run at once (BESIDE_THE_RANK_TESTS), and two jobs compiling the same graph into one directory at once is
# a documented limitation (docs/limitations.md), not what a test should meet by chance.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fsdp_graph_inductor_")
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        os.environ["TORCHINDUCTOR_CACHE_DIR"], os.environ["PYTEST_XDIST_WORKER"]
    )
# Ranks fork from one server that imported torch once (fsdp_graph.train.launch): each of the suite's ~150
# multi-rank runs would otherwise spend seconds importing torch in every rank.
os.environ.setdefault("FSDP_GRAPH_START_METHOD", "forkserver")
# The ranks' own gloo groups run on one worker thread (fsdp_graph.runtime.gloo.use_gloo_threads). The references
# (torch's FSDP2, DDP) keep several collectives in flight on them, and on torch's two threads that corrupts the heap:
# CI lost a run of the eager upstream checks to a SIGSEGV (2026-11-27).
os.environ.setdefault("FSDP_GRAPH_GLOO_THREADS", "1")

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

import tests.workers  # noqa: E402, F401  (the test processes' torch settings: tests/workers/__init__.py)

FAKE_WORLD = 4
RANKS_GROUP = "ranks"
# Rank tests that mostly wait, measured with the system's CPU ticks alone on 2 cores (2026-12-01): the soak's
# subprocess (39 s, 68% of both cores busy), the rank checks' timeouts (34 s, 48%), a killed and a stopped rank
# (15 s, 2-52%). In the rank tests' queue they would hold it while the cores idle; as tests of their own they run on
# the other xdist worker, after or between the single-process tests.
BESIDE_THE_RANK_TESTS = (
    "tests/numerics/test_soak.py::",
    "tests/numerics/test_rank_check.py::",
    "tests/numerics/test_train_job.py::test_killed_rank_",
    "tests/numerics/test_train_job.py::test_stopped_rank_",
    # Two ranks sharing one compile (issue 36: the first rank compiles, Inductor or eager kernels, while the other
    # waits for its artifacts), or both waiting on an injected delay: alone on the machine they kept its 2 cores 55-66% busy
    # (2026-12-07, /proc/stat over each test), where the rank queue's other tests keep them 80-96% busy. No module
    # fixture: each test is a scope of its own, as those above.
    "tests/numerics/test_block_reuse.py::",
    "tests/numerics/test_delays.py::",
    "tests/numerics/test_compress.py::test_compressed_gathers_and_gradients_match_a_quantizing_reference",
    "tests/numerics/test_shared_compile.py::test_one_rank_compiles_each_distinct_graph[2]",
    "tests/numerics/test_fsdp2_titan.py::test_torchtitan_apply_fsdp_matches_fsdp2[llama3]",
)


# The rank tests' queue outlasts the other worker's tests by minutes: the queue ends with the files whose ranks keep
# both cores busy alone (4 and 8 ranks; two ranks compiling different models), not with those whose ranks wait for
# each other (a shared compile, a job's subprocesses), which left a core idle once the other worker had finished:
# the last 250 s ran at 88% of the cores (2026-12-07, /proc/stat over each test).
RANK_QUEUE_LAST = ("tests/numerics/test_hf_models.py::", "tests/numerics/test_tensor_parallel.py::")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """RANK_QUEUE_LAST's files last, in that order; the rest in collection order (a stable sort)."""

    def last(item: pytest.Item) -> int:
        return next((i for i, prefix in enumerate(RANK_QUEUE_LAST) if item.nodeid.startswith(prefix)), -1)

    items.sort(key=last)


def pytest_collection_finish(session: pytest.Session) -> None:
    """The modules imported by collection (torch, transformers: about 380,000 objects the collector tracks) live as
    long as the session: out of the cyclic collector's reach, so that each full collection during the single-process
    tests scans only what the tests made (as the launcher does for its ranks, `fsdp_graph.train.launch._entry`)."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent where xdist is not installed
def pytest_xdist_make_scheduler(config, log):
    """Under `-n 2 --dist loadgroup` (the README's command) the multi-rank tests (tests/numerics: two or more rank
    processes each, both cores busy while they compute) run one after another on one xdist worker, while the other
    worker runs the single-process tests (tests/graphs) beside them, on the core the ranks leave idle while they wait
    for each other (a shared compile, a rank check, a collective); the rank tests that mostly wait
    (BESIDE_THE_RANK_TESTS) go to the other worker. Our own scope split, not `xdist_group` marks:
    xdist 3.8 renames a marked test's `_nodeid`, which pytest 9.2 no longer reads, so the marks group nothing."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class RankTestsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(BESIDE_THE_RANK_TESTS):
                return nodeid
            return RANKS_GROUP if nodeid.startswith("tests/numerics/") else nodeid

    return RankTestsTogether(config, log)


@pytest.fixture
def fake_pg():
    """A fake process group (world 4, this process rank 0): graphs compile, collectives move nothing."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=FAKE_WORLD)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture
def fake_world_8():
    """A fake world of 8 ranks, this process rank 5: (1, 0, 1) on a (2, 2, 2) mesh such as
    (replicate, shard, tp)."""
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _single_use_regions_inlined():
    """Each test starts with Dynamo inlining regions called once, torch's default: `fully_shard` of a model whose
    blocks hold a complex tensor turns that off for the whole process (`block_region.keep_complex_bodies_exact`),
    and a later test's graphs would otherwise depend on which tests ran before it on its worker."""
    import contextlib

    import torch._dynamo.config as dynamo_config

    inlining = hasattr(dynamo_config, "inline_single_use_invoke_subgraph")
    with dynamo_config.patch(inline_single_use_invoke_subgraph=True) if inlining else contextlib.nullcontext():
        yield
