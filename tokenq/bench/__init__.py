"""Benchmarks (`tokenq bench <target>`): each runs tokenq beside a reference in the same
run and reports ratios (docs/performance.md). None of this ships in a runtime room."""
