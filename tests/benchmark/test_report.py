import json

from flash_dma.benchmark.plots import plot_results
from flash_dma.benchmark.report import render_markdown, write_json, write_markdown
from flash_dma.benchmark.targets import evaluate
from tests.benchmark.fakes import case, passing_results, row, skipped

ENVIRONMENT = {
    "gpu": "NVIDIA H100 80GB HBM3",
    "torch": "2.11.0+cu130",
    "triton": "3.6.0",
    "cuda": "13.0",
    "date": "2026-11-22 08:00 UTC",
    "command": "flash_dma/cli.py bench --quick",
}


def _results():
    prefill = case("llm", "prefill", 4096, 1 / 8)
    decode = case("seed", "decode", 524288, 1 / 8)
    return [
        row(prefill, "flash-dma", "fwd", ms=0.05, tflops=350.0, peak_gib=0.0625),
        row(prefill, "flex", "fwd", ms=0.1),
        skipped(prefill, "sdpa-additive", "fwd", "OutOfMemoryError: CUDA out of memory"),
        row(prefill, "flash-dma", "fwdbwd", ms=0.4),
        row(decode, "flash-dma", "fwd", ms=0.02, gbps=840.0),
        skipped(decode, "flex", "fwd", "not run by default"),
    ]


def test_json_holds_environment_targets_and_every_row(tmp_path):
    results = _results()
    path = tmp_path / "results.json"
    write_json(path, ENVIRONMENT, results, evaluate(results))
    data = json.loads(path.read_text())
    assert data["environment"] == ENVIRONMENT
    assert len(data["targets"]) == 12 and {t["status"] for t in data["targets"]} == {"NO DATA"}
    assert len(data["results"]) == len(results)
    first, oom = data["results"][0], data["results"][2]
    assert first["case"]["seqlen_k"] == 4096 and first["case"]["keep"] == 0.125 and first["case"]["heads"] == 16
    assert (first["method"], first["mode"], first["status"], first["ms"]) == ("flash-dma", "fwd", "ok", 0.05)
    assert (oom["status"], oom["ms"], oom["note"]) == ("skipped", None, "OutOfMemoryError: CUDA out of memory")


def test_markdown_has_header_targets_and_grouped_tables(tmp_path):
    results = _results() + passing_results()
    path = tmp_path / "results.md"
    write_markdown(path, ENVIRONMENT, results, evaluate(results))
    text = path.read_text()
    assert text == render_markdown(ENVIRONMENT, results, evaluate(results))
    for expected in ("NVIDIA H100 80GB HBM3", "2.11.0+cu130", "| triton | 3.6.0 |", "| CUDA | 13.0 |",
                     "2026-11-22", "`flash_dma/cli.py bench --quick`", "## Targets", "**PASS**", "## Methods"):
        assert expected in text
    sections = [line for line in text.splitlines() if line.startswith("## ")]
    assert sections == [
        "## Targets", "## Methods",
        "## llm · prefill · forward",
        "## llm · prefill · forward + backward",
        "## seed · prefill · forward + backward",
        "## seed · decode · forward",
    ]
    llm_forward = text.split("## llm · prefill · forward\n")[1].split("##")[0]
    assert "GB/s" not in llm_forward  # bandwidth only where rows have it (decode)
    assert "| S=4096 keep=1/8 | 4/32 | flex | 0.1 | 100 | 1 | 2.00x | 0.5 |  |" in llm_forward
    assert "| sdpa-additive |  |  |  |  |  | skipped: OutOfMemoryError: CUDA out of memory |" in llm_forward
    assert "| S=16384 keep=1 | all | sdpa-flash | 3.3 | 332 |" in llm_forward
    decode = text.split("## seed · decode · forward\n")[1].split("##")[0]
    assert "| Sk=524288 keep=1/8 | 512/4096 | flash-dma | 0.02 | 100 | 840 | 1 | 1.00x |" in decode


def test_plot_is_written_with_data_and_without(tmp_path):
    plot_results(tmp_path / "results.png", _results() + passing_results())
    plot_results(tmp_path / "empty.png", [])
    for name in ("results.png", "empty.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
