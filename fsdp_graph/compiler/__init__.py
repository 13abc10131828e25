"""The compiler: the torch.compile backend that runs `passes/` and hands the result to Inductor, its options and dumps."""
