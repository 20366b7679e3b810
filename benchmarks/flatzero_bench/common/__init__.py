"""What the benchmarks share: settings, trials, results, the machine, child processes."""
