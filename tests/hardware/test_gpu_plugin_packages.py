"""The GPU platform plugins' packaging: one entry point each, and runtime-kernels (the triton backend) as a dependency."""

import pathlib
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["cuda", "rocm", "xpu"])
def test_pyproject_entry_point_and_dependencies(name):
    pyproject = tomllib.loads((ROOT / "hardware" / name / "pyproject.toml").read_text())
    project = pyproject["project"]
    assert project["name"] == f"runtime-plugin-{name}"
    assert project["entry-points"]["runtime"] == {name: f"runtime_{name}"}
    assert {"runtime", "runtime-kernels"} <= set(project["dependencies"])
    assert pyproject["build-system"]["build-backend"] == "setuptools.build_meta"


def test_runtime_kernels_is_the_plugin_that_registers_triton():
    project = tomllib.loads((ROOT / "kernels" / "pyproject.toml").read_text())["project"]
    assert project["name"] == "runtime-kernels"
    assert project["entry-points"]["runtime"] == {"kernels": "runtime_kernels.plugin"}
