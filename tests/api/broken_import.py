"""Imported by a solver worker in tests/api/test_execution.py: fails, as a module with a missing native library
would."""

raise ImportError("broken on purpose")
