"""Timer's benchmark kit: the scenarios behind bench/README.md's and the docs' figures,
run as ``python -m timer_bench <scenario>``. Imports nothing at package level, so the peers'
script can use :mod:`timer_bench.kit` where Timer is not installed."""
