"""The ``flash-dma`` command: ``--version``, ``--help`` without torch, and the optional dependencies
each subcommand checks before it runs."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import triton

import flash_dma
from flash_dma import cli

OPTIONAL_MODULES = ("matplotlib", "tqdm", "transformers")
ROOT = Path(__file__).resolve().parents[1]


def block(monkeypatch, *modules: str) -> None:
    """Make ``modules`` unimportable, as if not installed (``find_spec`` finds nothing either)."""
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


def test_version_names_flash_dma_torch_and_triton_without_optional_modules(monkeypatch, capsys):
    block(monkeypatch, *OPTIONAL_MODULES)
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    # The distributions' versions (a CUDA build's metadata may leave out the local tag, "+cu130").
    expected = f"flash-dma {flash_dma.__version__} (torch {cli.installed_version('torch')}, triton {cli.installed_version('triton')})\n"
    assert capsys.readouterr().out == expected


def test_versions_without_distribution_metadata_are_the_modules_own(monkeypatch):
    def not_installed(name):
        raise cli.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(cli.metadata, "version", not_installed)  # e.g. torch built from source
    assert (cli.installed_version("torch"), cli.installed_version("triton")) == (torch.__version__, triton.__version__)


def test_version_is_the_one_in_pyproject_installed_or_not(monkeypatch):
    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    declared = re.search(r'^version = "([^"]+)"', pyproject, re.MULTILINE).group(1)
    assert flash_dma.__version__ == declared

    def not_installed(name):
        raise flash_dma.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(flash_dma.metadata, "version", not_installed)
    assert flash_dma._version() == declared  # a checkout on PYTHONPATH reads its pyproject.toml


def test_help_and_version_import_neither_torch_nor_the_kernels():
    # In a new process (this one has imported torch): what parsing left in sys.modules, not a time.
    commands = [["--help"], ["--version"], *([name, "--help"] for name in cli.SUBCOMMANDS)]
    heavy = ["torch", "triton", "flash_dma.backends", *OPTIONAL_MODULES]
    script = textwrap.dedent("""
        import contextlib, io, json, sys
        from flash_dma import cli
        commands, heavy = json.loads(sys.argv[1]), json.loads(sys.argv[2])
        imported = {}
        for argv in commands:
            with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
                cli.main(argv)
            assert out.getvalue(), argv  # it answered
            imported[" ".join(argv)] = [module for module in heavy if module in sys.modules]
        print(json.dumps(imported))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, "-c", script, json.dumps(commands), json.dumps(heavy)],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    # Each entry lists what was imported by then: the first non-empty one names the command that imported it.
    assert json.loads(done.stdout) == {" ".join(argv): [] for argv in commands}


def test_every_subcommand_names_functions_that_exist():
    for subcommand in cli.SUBCOMMANDS.values():
        assert callable(cli.load(subcommand.arguments)) and callable(cli.load(subcommand.run))


@pytest.mark.parametrize(
    "argv, blocked, extra",
    [
        (["demo", "--smoke"], ("tqdm",), "demo"),
        (["demo", "--smoke"], ("matplotlib", "tqdm"), "demo"),
        (["bench", "--quick"], ("matplotlib",), "bench"),
        (["bench", "--quick"], ("transformers",), "bench"),
    ],
    ids=["demo-tqdm", "demo-both", "bench-matplotlib", "bench-transformers"],
)
def test_missing_optional_module_prints_the_install_line(monkeypatch, capsys, argv, blocked, extra):
    block(monkeypatch, *blocked)
    # The arguments parse, and the run's module (which imports the blocked modules) is never imported.
    command = argv[0]
    assert cli.main(argv) == 2
    printed = capsys.readouterr()
    assert printed.out == ""
    assert printed.err == (
        f"flash-dma {command}: missing optional dependencies ({', '.join(blocked)}); install them with:\n"
        f"    pip install 'flash-dma[{extra}]'\n"
    )


@pytest.mark.parametrize("command", list(cli.SUBCOMMANDS))
def test_help_needs_no_optional_module(monkeypatch, capsys, command):
    block(monkeypatch, *OPTIONAL_MODULES)
    with pytest.raises(SystemExit) as exited:
        cli.main([command, "--help"])
    assert exited.value.code == 0 and f"usage: flash-dma {command}" in capsys.readouterr().out


def test_every_optional_module_is_in_the_extra_it_names():
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    for name, subcommand in cli.SUBCOMMANDS.items():
        for module, extra in subcommand.requires.items():
            # These modules are named as their distributions are.
            packages = {re.match(r"[A-Za-z0-9_.-]+", requirement).group() for requirement in extras[extra]}
            assert module in packages, f"{name}: {module} is not in flash-dma[{extra}]"
