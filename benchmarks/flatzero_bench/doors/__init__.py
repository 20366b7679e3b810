"""``flatzero bench doors``: flatzero.initialize against deepspeed.initialize, fresh jobs."""
