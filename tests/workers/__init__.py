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
