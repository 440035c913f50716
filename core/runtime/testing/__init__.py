"""Test kit for the runtime and its plugins.

* :mod:`runtime.testing.models`: tiny random Hugging Face checkpoints of every supported
  architecture, built offline;
* :mod:`runtime.testing.reference`: transformers' greedy outputs and vLLM-style comparisons;
* :mod:`runtime.testing.conformance`: the parity suite a platform or attention-backend
  plugin runs against itself; :mod:`runtime.testing.plugin` is its pytest plugin
  (``--platform``, ``--attention-backend``). Run it with
  ``pytest -p runtime.testing.plugin --pyargs runtime.testing --platform NAME --attention-backend NAME``.
"""
