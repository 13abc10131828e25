"""The training application: the main job (`python -m fsdp_graph train`), its Llama model, corpus, report and
the local process launcher."""
