"""``flatzero bench load``: direct load into the flat buffers against load plus flatten."""
