"""Model implementations, registered by Hugging Face architecture name in ``runtime.builtins``."""
