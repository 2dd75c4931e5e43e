"""flashspec's tests: one folder per package they test, shared code in ``tests.helpers``
(the rules: tests/project/test_layout.py)."""
