"""The plugin template, end to end.

Render it with `cookiecutter --no-input`, install the result with `runtime plugins
install -e`, check that `runtime plugins --json` (a fresh process) lists it, generate
text with the attention backend it registers, run the generated project's own tests,
then `runtime plugins uninstall` it.

The plugin goes into a virtual environment over this one's packages (``--system-site-packages``),
not into this environment: processes of the rest of the suite, which may run at the same time
(pytest-xdist), would otherwise find its entry point and fail to load it while it is being
installed or removed. This process sees it by putting that environment's site-packages (its
distribution's metadata) and the project (its module) on ``sys.path``.
"""

import importlib
import json
import os
import pathlib
import subprocess
import sys
import tomllib
from importlib import metadata

import pytest
import torch
import yaml

from runtime import LLM, SamplingParams, plugins

from runtime.testing.models import build_tiny_model

TEMPLATE = pathlib.Path(__file__).resolve().parents[2] / "plugin-template"
# Unique per process, so that concurrent runs of this suite do not share an installation.
PLUGIN_NAME = f"Tmpl Check {os.getpid()}"
HYPHENATED = PLUGIN_NAME.lower().replace(" ", "-")
UNDERSCORED = HYPHENATED.replace("-", "_")
DISTRIBUTION = f"runtime-plugin-{HYPHENATED}"
MODULE = f"runtime_{UNDERSCORED}"
BACKEND = f"{UNDERSCORED}_sdpa"


def _run(*args, cwd=None, timeout=300, python=sys.executable):
    env = {k: v for k, v in os.environ.items() if k != plugins.ALLOW_LIST_ENV}
    return subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    """(python, site-packages) of a virtual environment that sees this one's packages."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(root)], check=True)
    return root / "bin" / "python", next((root / "lib").glob("python*/site-packages"))


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    out = tmp_path_factory.mktemp("rendered")
    result = _run(
        "-m", "cookiecutter", "--no-input", str(TEMPLATE), "-o", str(out),
        f"plugin_name={PLUGIN_NAME}", "description=A test plugin",
    )
    assert result.returncode == 0, result.stderr
    return out / DISTRIBUTION


@pytest.fixture(scope="module")
def installed(project, venv):
    """The rendered project installed (editable) with `runtime plugins install` into ``venv``;
    uninstalled afterwards."""
    python, site = venv
    saved = plugins._manager
    result = _run("-m", "runtime.cli.main", "plugins", "install", "-e", str(project), "--no-deps",
                  "--no-build-isolation", python=python)
    assert result.returncode == 0, result.stdout + result.stderr
    # The editable install's import hook is read at interpreter start; this process finds the
    # distribution's metadata in the environment's site-packages and imports the module from the project.
    sys.path[:0] = [str(site), str(project)]
    try:
        importlib.invalidate_caches()
        assert metadata.distribution(DISTRIBUTION).version == "0.1.0"
        yield project
    finally:
        plugins.reset_plugin_manager(saved)
        for path in (str(site), str(project)):
            sys.path.remove(path)
        for name in [m for m in sys.modules if m == MODULE or m.startswith(MODULE + ".")]:
            del sys.modules[name]
        importlib.invalidate_caches()
        result = _run("-m", "runtime.cli.main", "--plugins", "", "plugins", "uninstall", DISTRIBUTION, "-y",
                      python=python)
        assert result.returncode == 0, result.stdout + result.stderr
        gone = _run("-c", f"import importlib.metadata as m; m.distribution({DISTRIBUTION!r})", python=python)
        assert gone.returncode != 0 and "PackageNotFoundError" in gone.stderr


def test_rendered_files(project):
    files = sorted(str(p.relative_to(project)) for p in project.rglob("*") if p.is_file())
    assert files == sorted([
        ".github/workflows/ci.yml", ".gitignore", "README.md", "pyproject.toml",
        f"{MODULE}/__init__.py", f"{MODULE}/attention.py",
        f"tests/test_{UNDERSCORED}.py", "tests/test_conformance.py",
    ])
    pyproject = tomllib.loads((project / "pyproject.toml").read_text())
    assert pyproject["build-system"]["build-backend"] == "setuptools.build_meta"
    assert pyproject["project"]["name"] == DISTRIBUTION
    assert pyproject["project"]["description"] == "A test plugin"
    assert pyproject["project"]["dependencies"] == ["runtime"]
    assert pyproject["project"]["entry-points"]["runtime"] == {HYPHENATED: MODULE}
    workflow = yaml.safe_load((project / ".github/workflows/ci.yml").read_text())
    steps = workflow["jobs"]["test"]["steps"]
    assert steps[1]["with"]["python-version"] == "${{ matrix.python-version }}"  # kept for GitHub, not Jinja
    assert any("pytest" in step.get("run", "") for step in steps)
    source = (project / MODULE / "__init__.py").read_text()
    for hook in ("platforms", "quant_methods", "proposers", "kv_connectors", "kv_tiers", "executors", "models",
                 "guided_backends", "commands", "routes"):
        assert f"# def register_{hook}(" in source  # a commented example of every other hook
    for path in project.rglob("*"):
        if path.is_file():
            assert "cookiecutter" not in path.read_text(), path


def test_generated_tests_get_the_cpu_platform_they_run_on(project):
    """The conformance tests pin the `cpu` platform, which only runtime-plugin-cpu registers: the
    `test` extra and the generated CI must install it, or a fresh environment fails them all."""
    pyproject = tomllib.loads((project / "pyproject.toml").read_text())
    assert "runtime-plugin-cpu" in pyproject["project"]["optional-dependencies"]["test"]
    assert 'ConformanceTarget("cpu"' in (project / "tests" / "test_conformance.py").read_text()
    workflow = yaml.safe_load((project / ".github/workflows/ci.yml").read_text())
    job = workflow["jobs"]["test"]
    install = next(step["run"] for step in job["steps"] if "RUNTIME_REQUIREMENT" in step.get("run", ""))
    assert job["env"]["RUNTIME_CPU_REQUIREMENT"] == "runtime-plugin-cpu" and "$RUNTIME_CPU_REQUIREMENT" in install


def test_prompts_for_name_and_description(tmp_path):
    answers = 'Fancy Attn\nA "fancy" \\ backend\n'
    result = subprocess.run(
        [sys.executable, "-m", "cookiecutter", str(TEMPLATE), "-o", str(tmp_path)],
        input=answers, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "Plugin name" in result.stdout and "description" in result.stdout
    pyproject = tomllib.loads((tmp_path / "runtime-plugin-fancy-attn" / "pyproject.toml").read_text())
    assert pyproject["project"]["description"] == 'A "fancy" \\ backend'
    assert (tmp_path / "runtime-plugin-fancy-attn" / "runtime_fancy_attn" / "attention.py").exists()


def test_invalid_plugin_name_is_refused(tmp_path):
    result = _run("-m", "cookiecutter", "--no-input", str(TEMPLATE), "-o", str(tmp_path), "plugin_name=9 lives")
    assert result.returncode != 0
    assert "not a valid Python identifier" in result.stderr + result.stdout
    assert not any(tmp_path.iterdir())


def test_listed_by_runtime_plugins_in_a_fresh_process(installed, venv):
    result = _run("-m", "runtime.cli.main", "plugins", "--json", python=venv[0])
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert rows[HYPHENATED]["distribution"] == DISTRIBUTION
    assert rows[HYPHENATED]["version"] == "0.1.0"
    assert rows[HYPHENATED]["registered"] == {"attention_backend": [BACKEND]}
    assert rows[HYPHENATED]["hooks"] == ["register_attention_backends"]
    # --plugins loads only the named plugin (and the core)
    result = _run("-m", "runtime.cli.main", "plugins", "--plugins", HYPHENATED, "--json", python=venv[0])
    assert result.returncode == 0, result.stderr
    assert {row["name"] for row in json.loads(result.stdout)} == {plugins.BUILTIN_PLUGIN_NAME, HYPHENATED}


def test_backend_selected_by_flag_and_used_in_generation(installed, plugin_manager, tmp_path):
    from transformers import AutoModelForCausalLM

    assert plugin_manager.infos[HYPHENATED].distribution == DISTRIBUTION  # loaded from its entry point
    backend_cls = importlib.import_module(f"{MODULE}.attention").__dict__[
        "".join(part.capitalize() for part in UNDERSCORED.split("_")) + "AttentionBackend"
    ]
    path = build_tiny_model("llama", tmp_path / "llama")
    prompt = [1, 523, 4021, 88, 1307, 42, 9]
    calls = backend_cls.forward_calls
    llm = LLM(path, attention_backend=BACKEND, dtype="float32", max_model_len=64, block_size=8)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert type(llm.llm_engine.engine_core.executor.worker.model_runner.attn_backend) is backend_cls
    # prefill + 7 decode steps, each through both layers
    assert backend_cls.forward_calls - calls == 8 * 2
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(8):  # greedy, ignoring EOS like the request
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert list(out[0].outputs[0].token_ids) == ids[0, len(prompt):].tolist()


# The generated tests include the whole conformance kit; CI runs its Llama and Gemma 3 cases
# (Gemma 3 covers sliding windows and soft-capping), every setting, to stay within its budget.
CONFORMANCE_SLICE = "not test_greedy_tokens_match_transformers or llama or gemma3"


def test_generated_projects_own_tests_pass(installed, venv):
    result = _run("-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", CONFORMANCE_SLICE, cwd=installed, timeout=900,
                  python=venv[0])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout
    assert "test_conformance.py" in _run("-m", "pytest", "--collect-only", "-q", cwd=installed, python=venv[0]).stdout


def test_the_rest_of_the_suite_does_not_see_it(installed):
    """This environment's processes (the other tests', servers') list no such plugin."""
    result = _run("-m", "runtime.cli.main", "plugins", "--json")
    assert result.returncode == 0, result.stderr
    assert HYPHENATED not in {row["name"] for row in json.loads(result.stdout)}
