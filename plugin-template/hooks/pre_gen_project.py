"""Refuse plugin names that do not make a Python module name."""

import re
import sys

MODULE = "runtime_{{ cookiecutter.__underscored }}"

if not re.fullmatch(r"runtime_[a-z][a-z0-9_]*", MODULE):
    print(
        f"ERROR: the plugin name gives the module name {MODULE!r}, which is not a valid Python identifier; "
        "use letters, digits, spaces, '-' or '_', starting with a letter",
        file=sys.stderr,
    )
    sys.exit(1)
