"""One-off studies: measurements whose results are committed under ``benchmarks/results`` and cited
by the docs. Not installed (pyproject excludes ``benchmarks.studies``) and imported by no product
module or test; run from a checkout, ``python -m benchmarks.studies.<name>``, and test with
``pytest benchmarks/studies``. Each module's first line says what it measured and where its result is."""
