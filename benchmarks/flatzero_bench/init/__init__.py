"""``flatzero bench init``: flatten and initialize against DeepSpeed and the hardware."""
