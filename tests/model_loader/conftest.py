import os
import sys

# Let tests import the shared helpers: tests/tiny_models.py and tests/models/paged_batch.py.
_TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (_TESTS_DIR, os.path.join(_TESTS_DIR, "models")):
    if _path not in sys.path:
        sys.path.insert(0, _path)
