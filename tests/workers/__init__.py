"""Rank-side code of the multi-rank tests: models, workers the launcher runs in each rank, helpers.

Importing this package imports what torch imports lazily on a process's first compile (AOT autograd, the min-cut
partitioner and its networkx, torch.export's tracing, Inductor's compile_fx, C++ codegen and builder: about 800
modules, over 1 s of CPU), and the Hugging Face modules most of the tests' models come from (transformers, its Llama
and GPT-2: 1.75 s a rank, in each test whose ranks build one). The suite's ranks fork from a forkserver that
preloads the first worker's module (fsdp_graph.train.launch), so the server imports them once and no rank pays for
them again: a rank's first compile with eager kernels measured 1.1 s -> 0.2 s.
"""

import importlib

for _module in (
    "torch._dynamo.backends.common",
    "torch._dynamo.repro.after_aot",
    "torch._functorch.aot_autograd",
    "torch._functorch.partitioners",
    "functorch.compile",
    "networkx",
    "torch.export._trace",
    "torch._inductor.compile_fx",
    "torch._inductor.codegen.cpp",
    "torch._inductor.cpp_builder",
    "torch.utils.cpp_extension",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
):
    try:
        importlib.import_module(_module)
    # Another torch may name them otherwise, transformers may be absent or refuse this torch: then the ranks import
    # what they use, and meet any such error there, in the test that needs the module.
    except Exception:
        pass
