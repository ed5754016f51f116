"""The benchmark scripts' tests. A package, so that pytest imports bench/tests/conftest.py as tests.conftest
and not as `conftest`, the module tests/'s files import their helpers from (python -m pytest -q tests
bench/tests loads both conftest files before it collects a test)."""
