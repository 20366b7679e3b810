"""``flatzero bench muon``: Newton-Schulz work per rank against DeepSpeed's Muon."""
