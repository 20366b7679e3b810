"""``flatzero bench step``: the training step against AdamW and DeepSpeed ZeRO."""
