"""``flatzero bench offload``: optimizer offload kernel, step and init against DeepSpeed."""
