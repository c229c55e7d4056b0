"""The ``flash-dma`` command: ``--version``, and the optional dependencies each subcommand checks first."""

import re
import sys
from pathlib import Path

import pytest
import torch
import triton

import flash_dma
from flash_dma import cli

OPTIONAL_MODULES = ("matplotlib", "tqdm", "transformers")


def block(monkeypatch, *modules: str) -> None:
    """Make ``modules`` unimportable, as if not installed (``find_spec`` finds nothing either)."""
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


def test_version_names_flash_dma_torch_and_triton_without_optional_modules(monkeypatch, capsys):
    block(monkeypatch, *OPTIONAL_MODULES)
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    expected = f"flash-dma {flash_dma.__version__} (torch {torch.__version__}, triton {triton.__version__})\n"
    assert capsys.readouterr().out == expected


def test_version_is_the_one_in_pyproject_installed_or_not(monkeypatch):
    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    declared = re.search(r'^version = "([^"]+)"', pyproject, re.MULTILINE).group(1)
    assert flash_dma.__version__ == declared

    def not_installed(name):
        raise flash_dma.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(flash_dma.metadata, "version", not_installed)
    assert flash_dma._version() == declared  # a checkout on PYTHONPATH reads its pyproject.toml


@pytest.mark.parametrize(
    "command, blocked, extra",
    [
        ("demo", ("tqdm",), "demo"),
        ("demo", ("matplotlib", "tqdm"), "demo"),
        ("bench", ("matplotlib",), "bench"),
        ("bench", ("transformers",), "bench"),
    ],
    ids=["demo-tqdm", "demo-both", "bench-matplotlib", "bench-transformers"],
)
def test_missing_optional_module_prints_the_install_line(monkeypatch, capsys, command, blocked, extra):
    block(monkeypatch, *blocked)
    # An unknown option: had the subcommand's parser been built, argparse would exit instead of returning.
    assert cli.main([command, "--no-such-option"]) == 2
    printed = capsys.readouterr()
    assert printed.out == ""
    assert printed.err == (
        f"flash-dma {command}: missing optional dependencies ({', '.join(blocked)}); install them with:\n"
        f"    pip install 'flash-dma[{extra}]'\n"
    )


def test_selfcheck_needs_no_optional_module(monkeypatch, capsys):
    block(monkeypatch, *OPTIONAL_MODULES)
    with pytest.raises(SystemExit) as exited:
        cli.main(["selfcheck", "--help"])
    assert exited.value.code == 0 and "--device" in capsys.readouterr().out


def test_every_optional_module_is_in_the_extra_it_names():
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    for name, subcommand in cli.SUBCOMMANDS.items():
        for module, extra in subcommand.requires.items():
            # These modules are named as their distributions are.
            packages = {re.match(r"[A-Za-z0-9_.-]+", requirement).group() for requirement in extras[extra]}
            assert module in packages, f"{name}: {module} is not in flash-dma[{extra}]"
