"""``flatzero bench checkpoint``: verified against unverified loads; step time lost to a save."""
