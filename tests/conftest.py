"""Shared test configuration. (``tests/`` is on the import path through pytest's ``pythonpath`` setting,
so the oracle, the cases and the helpers import by name.)"""
