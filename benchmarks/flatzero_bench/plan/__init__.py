"""``flatzero bench plan``: flatzero plan's predicted CPU init time against a measured one."""
