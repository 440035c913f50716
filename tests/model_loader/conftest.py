import os
import sys

# test_gguf.py drives models with the paged-cache helper of tests/models/paged_batch.py.
_MODELS_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")
if _MODELS_TESTS not in sys.path:
    sys.path.insert(0, _MODELS_TESTS)
