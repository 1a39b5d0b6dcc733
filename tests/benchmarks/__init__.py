"""CPU tests of the benchmarks' own logic (their figures come from runs, not tests)."""
