"""The studies a later change re-runs (benchmarks/README.md, "Studies", says which and for what):
measurements whose results go under ``benchmarks/results`` and are cited by the docs. Not installed
(pyproject excludes ``benchmarks.studies``) and imported by no product module or test; run from a
checkout, ``python -m benchmarks.studies.<name>``, and test with ``pytest benchmarks/studies``. Each
module's first line says what it measures and where its result goes."""
