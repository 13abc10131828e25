"""Rank-side code of the multi-rank tests: models, workers the launcher runs in each rank, helpers.

Importing this package imports the Hugging Face modules most of the tests' models come from (transformers, its
Llama and GPT-2: 1.75 s a rank, in each test whose ranks build one). The suite's ranks fork from a forkserver that
preloads the first worker's module, so the server imports them once and no rank pays for them again; the server's
own warm-up (`fsdp_graph.train.warm_start`) loads the compile stack.
"""

import importlib

for _module in ("transformers", "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2"):
    try:
        importlib.import_module(_module)
    # transformers may be absent or refuse this torch: then the ranks import what they use, and meet any such error
    # there, in the test that needs the module.
    except Exception:
        pass

# torch times each new set of guards once, right after building it, behind a flush of the CPU caches
# (`profile_guard_manager`), for its debug log and compile metrics only: about 22 ms a compile on these machines,
# about 2% of the suite's CPU over its thousands of compiles. No test reads the figure; the guards are still built
# and checked as users' are. (A torch without the function is left as it is.)
import torch._dynamo.guards as _dynamo_guards  # noqa: E402

if hasattr(_dynamo_guards, "profile_guard_manager"):
    _dynamo_guards.profile_guard_manager = lambda *args, **kwargs: 0.0
