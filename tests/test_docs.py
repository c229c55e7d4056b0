"""The docs stay true: every ```python block of the README and docs/ runs as written, and every
section of the design notes that the code or the docs cite by name is there.

Each block runs in a fresh namespace, on the CPU with the reference backend where no GPU is
present (the blocks pick ``device = "cuda" if torch.cuda.is_available() else "cpu"`` themselves).
A block after the line ``<!-- docs-test: signature -->`` (an HTML comment, not rendered) is a call
signature, ``name(parameters)``, checked against the function of that name in ``flash_dma``
(parameter names, kinds and defaults) instead of run.
"""

from __future__ import annotations

import ast
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import flash_dma
from flash_dma.benchmark.suites import SUITES

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
MARKS = ("signature",)
_BLOCK = re.compile(r"^(?:<!-- docs-test: (?P<mark>[\w-]+) -->\n)?```python\n(?P<code>.*?)^```$", re.M | re.S)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence
    code: str
    mark: str | None

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def python_blocks(path: Path) -> list[Block]:
    text = path.read_text()
    blocks = []
    for found in _BLOCK.finditer(text):
        fence = found.start("code") - len("```python\n")
        blocks.append(Block(path, text.count("\n", 0, fence) + 1, found["code"], found["mark"]))
    return blocks


BLOCKS = [block for path in DOCUMENTS for block in python_blocks(path)]


def test_every_python_block_is_collected_with_a_known_mark():
    fences = sum(path.read_text().count("```python\n") for path in DOCUMENTS)
    assert len(BLOCKS) == fences > 0
    assert {block.mark for block in BLOCKS} <= {None, *MARKS}


def _isolated():
    """Undo what a block may leave behind in this process: a default process group."""
    had_group = dist.is_available() and dist.is_initialized()
    return lambda: (not had_group and dist.is_available() and dist.is_initialized()) and dist.destroy_process_group()


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.mark != "signature"], ids=str)
def test_block_runs_as_written(block):
    cleanup = _isolated()
    torch.manual_seed(0)
    try:
        exec(compile(block.code, str(block), "exec"), {"__name__": "__docs__"})
    finally:
        cleanup()


def _documented(code: str) -> tuple[str, ast.arguments]:
    """The function name and parameters of ``[out = ]name(parameters)[ -> annotation]``."""
    call = re.sub(r"^\w+ = ", "", code.strip())
    name, rest = call.split("(", 1)
    tree = ast.parse(f"def {name}({rest}: pass")
    return name, tree.body[0].args


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.mark == "signature"], ids=str)
def test_signature_matches_the_function(block):
    name, documented = _documented(block.code)
    actual = inspect.signature(getattr(flash_dma, name)).parameters
    positional = documented.posonlyargs + documented.args
    defaults = [None] * (len(positional) - len(documented.defaults)) + documented.defaults
    expected = [(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, d) for a, d in zip(positional, defaults)]
    expected += [(a.arg, inspect.Parameter.KEYWORD_ONLY, d) for a, d in zip(documented.kwonlyargs, documented.kw_defaults)]
    assert [(p.name, p.kind) for p in actual.values()] == [(n, k) for n, k, _ in expected]
    for parameter_name, _, default in expected:
        wanted = inspect.Parameter.empty if default is None else ast.literal_eval(default)
        assert actual[parameter_name].default == wanted, parameter_name


def test_benchmark_readme_lists_the_cli_suites():
    text = (ROOT / "benchmarks" / "README.md").read_text()
    assert f"`--suite {{{','.join((*SUITES, 'all'))}}}`" in text
    assert "H100 machine" not in text


# A citation: design notes, "Section" (or docs/design-notes.md, "Section"), its name possibly
# wrapped over comment or docstring lines.
_CITATION = re.compile(r'design[- ]notes(?:\.md)?,?\s*"([^"]+)"')


def _cited_sections(text: str) -> set[str]:
    unwrapped = re.sub(r"\n\s*(?:#\s*)?", " ", text)
    return {re.sub(r"\s+", " ", name).strip() for name in _CITATION.findall(unwrapped)}


def test_cited_design_note_sections_exist():
    notes = ROOT / "docs" / "design-notes.md"
    headings = {line.lstrip("#").strip() for line in notes.read_text().splitlines() if line.startswith("#")}
    sources = [*DOCUMENTS, *(path for folder in ("flash_dma", "tools", "benchmarks", "tests")
                            for path in sorted((ROOT / folder).rglob("*.py")))]
    cited = {name: path for path in sources if path != Path(__file__).resolve() for name in _cited_sections(path.read_text())}
    missing = {name: str(path.relative_to(ROOT)) for name, path in cited.items() if name not in headings}
    assert cited and not missing
