import os

import pytest
import torch

# Tests see every installed plugin unless a test narrows it.
os.environ.pop("RUNTIME_PLUGINS", None)

# Triton decides at import whether its own library functions (tl.zeros, ...) are interpreted,
# and test modules may import it indirectly (transformers does), so choose before any of them
# load: the interpreter without a GPU. An explicit value in the environment wins.
# torch.cuda.device_count() asks NVML and does not start CUDA.
# This is the one place that chooses it.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.device_count() > 0 else "1")

# The CPU platform compiles decode steps by default, seconds to a minute per engine start; the
# suite starts hundreds of engines (and servers, which inherit this), so it runs them eagerly.
# tests/cpu_fast turns compiling on where it checks the compiled path. An explicit value wins.
os.environ.setdefault("RUNTIME_CPU_COMPILE", "0")


@pytest.fixture(scope="session")
def kernel_device() -> str:
    """Where Triton kernels run: ``cpu`` under the interpreter, ``cuda`` when compiling for a GPU."""
    if os.environ["TRITON_INTERPRET"] == "1":
        return "cpu"
    if not torch.cuda.is_available():
        pytest.fail("TRITON_INTERPRET=0 needs a CUDA GPU")
    return "cuda"


@pytest.fixture(scope="session")
def run_shared_dir(tmp_path_factory):
    """A folder that every xdist worker of this run shares (the parent of the workers' temporary roots)."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


@pytest.fixture
def plugin_manager():
    """A fresh process-wide plugin manager, restored afterwards."""
    from runtime import plugins

    saved = plugins._manager
    manager = plugins.PluginManager(plugins.parse_allow_list(os.environ.get(plugins.ALLOW_LIST_ENV)))
    plugins.reset_plugin_manager(manager)
    yield manager
    plugins.reset_plugin_manager(saved)
