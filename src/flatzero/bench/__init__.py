"""Benchmark support: DeepSpeed-faithful baselines, hardware limits, a real DeepSpeed runner."""
