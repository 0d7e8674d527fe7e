"""The lab: one-off experiments, each answered in docs/benchmarks.md (README.md here indexes them). Nothing in the
product imports them; run one as `python -m bench.lab.NAME`."""
