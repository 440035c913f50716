"""`runtime plugins install/uninstall`: the pip command lines and the errors.

The successful path (install -e of a local plugin folder, listed, uninstalled) runs in
tests/plugin_template/, on the project the template generates.
"""

import json
import sys

import pytest

from runtime.cli import main as cli
from runtime.cli import plugins_install


def _parse(argv):
    return cli.build_parser().parse_args(argv)


def test_listing_without_a_subcommand_still_works(plugin_manager, capsys):
    assert cli.main(["plugins"]) == 0
    assert "cpu 0.1.0 (runtime-plugin-cpu)" in capsys.readouterr().out
    assert cli.main(["plugins", "--json", "--hook", "register_platforms"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert "cpu" in {row["name"] for row in rows}
    assert all("register_platforms" in row["hooks"] for row in rows)


def test_install_command_line(plugin_manager, tmp_path):
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    args = _parse(["plugins", "install", "-e", str(tmp_path), "-U", "--no-deps"])
    assert args.func is plugins_install.run_install
    assert plugins_install.install_command(args) == [
        sys.executable, "-m", "pip", "install", "--upgrade", "--no-deps", "-e", str(tmp_path)
    ]
    args = _parse(["plugins", "install", "runtime-plugin-foo", "--no-build-isolation"])
    assert plugins_install.install_command(args) == [
        sys.executable, "-m", "pip", "install", "--no-build-isolation", "runtime-plugin-foo"
    ]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["./no-such-plugin"], "no such plugin folder or archive: './no-such-plugin' does not exist"),
        (["-e", "no-such-plugin"], "editable install needs a project folder: 'no-such-plugin' does not exist"),
        (["dist/plugin-0.1-py3-none-any.whl"], "no such plugin folder or archive"),
    ],
)
def test_install_of_a_missing_path_is_a_clear_error(plugin_manager, capsys, monkeypatch, argv, message):
    monkeypatch.setattr(plugins_install, "run_pip", lambda cmd: pytest.fail(f"pip ran: {cmd}"))
    assert cli.main(["plugins", "install", *argv]) == 2
    assert f"runtime: error: {message}" in capsys.readouterr().err


def test_install_of_a_folder_that_is_no_project(plugin_manager, tmp_path, capsys):
    assert cli.main(["plugins", "install", "-e", str(tmp_path)]) == 2
    assert "is not a Python project: it has none of pyproject.toml, setup.py, setup.cfg" in capsys.readouterr().err


def test_pip_failure_exit_code_is_propagated(plugin_manager, tmp_path, capfd):
    (tmp_path / "pyproject.toml").write_text("[project\nthis is not toml\n")
    rc = cli.main(["plugins", "install", "--no-deps", "--no-build-isolation", str(tmp_path)])
    err = capfd.readouterr().err
    assert rc != 0  # pip's own exit code, passed on
    assert f"runtime: error: pip failed with exit code {rc}: {sys.executable} -m pip install" in err


def test_uninstall_resolves_plugin_names_and_passes_yes(plugin_manager, monkeypatch):
    ran = []
    monkeypatch.setattr(plugins_install, "run_pip", lambda cmd: ran.append(cmd) or 0)
    assert cli.main(["plugins", "uninstall", "cpu", "-y"]) == 0  # entry-point name -> distribution
    assert ran == [[sys.executable, "-m", "pip", "uninstall", "--yes", "runtime-plugin-cpu"]]
    assert cli.main(["plugins", "uninstall", "runtime-plugin-cpu"]) == 0  # asks pip to confirm
    assert ran[-1] == [sys.executable, "-m", "pip", "uninstall", "runtime-plugin-cpu"]


def test_uninstall_errors(plugin_manager, capsys, monkeypatch):
    monkeypatch.setattr(plugins_install, "run_pip", lambda cmd: pytest.fail(f"pip ran: {cmd}"))
    assert cli.main(["plugins", "uninstall", "runtime-plugin-nope", "-y"]) == 2
    err = capsys.readouterr().err
    assert "'runtime-plugin-nope' is not installed; installed plugins: " in err and "runtime-plugin-cpu" in err
    assert cli.main(["plugins", "uninstall", "runtime", "-y"]) == 2
    assert "refusing to uninstall the core package 'runtime'" in capsys.readouterr().err


def test_run_pip_reports_the_exit_code(capfd):
    rc = plugins_install.run_pip([sys.executable, "-c", "import sys; sys.exit(3)"])
    assert rc == 3
    assert "pip failed with exit code 3" in capfd.readouterr().err


def test_uninstall_refuses_a_package_that_is_no_plugin(plugin_manager, capsys, monkeypatch):
    """`runtime plugins uninstall pytest` must not hand pytest (or torch...) to pip."""
    monkeypatch.setattr(plugins_install, "run_pip", lambda cmd: pytest.fail(f"pip ran: {cmd}"))
    assert cli.main(["plugins", "uninstall", "pytest", "-y"]) == 2
    err = capsys.readouterr().err
    assert "refusing to uninstall 'pytest': it is not a runtime plugin" in err and "runtime-plugin-cpu" in err
    assert plugins_install.resolve_uninstall_name("Runtime_Plugin.CPU") == "Runtime_Plugin.CPU"  # pip's spelling rules
