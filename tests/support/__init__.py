"""Helpers shared by the test suite (on the path through pytest's ``pythonpath``)."""
