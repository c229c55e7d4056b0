import json

from flash_dma.benchmark.report import render_markdown, write_json, write_markdown
from flash_dma.benchmark.targets import TARGETS, evaluate
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
    prefill = case("llm", "prefill", 4096, 1 / 4)  # a case of its own: passing_results() has keep 1/8
    decode = case("seed", "decode", 524288, 1 / 8)
    return [
        row(prefill, "flash-dma", "fwd", ms=0.05, tflops=350.0, peak_gib=0.0625),
        row(prefill, "flex", "fwd", ms=0.1),
        skipped(prefill, "sdpa-additive", "fwd", "OutOfMemoryError: CUDA out of memory"),
        row(prefill, "flash-dma", "fwdbwd", ms=0.4, sm_clock="1800-1815 MHz (power cap)"),
        row(decode, "flash-dma", "fwd", ms=0.02, gbps=840.0),
        skipped(decode, "flex", "fwd", "not run by default"),
    ]


def test_json_holds_environment_targets_and_every_row(tmp_path):
    results = _results()
    path = tmp_path / "results.json"
    write_json(path, ENVIRONMENT, results, evaluate(passing_results() + results))
    data = json.loads(path.read_text())
    assert data["environment"] == ENVIRONMENT
    assert len(data["targets"]) == len(TARGETS) and {t["status"] for t in data["targets"]} == {"PASS"}
    assert data["targets"][0]["unit"] == "x" and data["targets"][-1]["unit"] == "µs"
    assert len(data["results"]) == len(results)
    first, oom = data["results"][0], data["results"][2]
    assert first["case"]["seqlen_k"] == 4096 and first["case"]["keep"] == 0.25 and first["case"]["heads"] == 16
    assert (first["case"]["mask"], first["case"]["cache"]) == ("block", None)
    assert (first["method"], first["mode"], first["status"], first["ms"]) == ("flash-dma", "fwd", "ok", 0.05)
    assert first["cpu_ms"] is None
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
        "## seedtable · window · forward",
        "## seedtable · window · forward + backward",
        "## pqtoken · prefill · forward",
        "## pqtoken · prefill · forward + backward",
        "## topk · prefill · forward",
        "## topk · prefill · forward + backward",
        "## topkq · prefill · forward",
        "## topkq · prefill · forward + backward",
        "## token · prefill · forward",
        "## token · prefill · forward + backward",
        "## seed · prefill · forward",
        "## seed · prefill · forward + backward",
        "## seed · decode · forward",
        "## host · host time per call · forward",
        "## host · host time per call · forward + backward",
        "## llama · train step · forward + backward",
        "## doge · train step · forward + backward",
        "## layer · train step · forward + backward",
        "## layer · key selection · forward",
        "## firstcall · prefill · forward + backward",
        "## firstcall · generate · forward",
        "## varlen · prefill · forward",
        "## varlen · prefill · forward + backward",
        "## kvcache · decode · forward",
        "## forms · prefill · forward",
        "## forms · prefill · forward + backward",
        "## topkfit · prefill · forward",
        "## topkfit · prefill · forward + backward",
    ]
    assert "| host S=128 mask+bias fwd: flash-dma host time per call | <= 40 µs | 20 µs | **PASS** |" in text


def _section(text: str, title: str) -> str:
    return text.split(f"## {title}\n")[1].split("##")[0]


def test_markdown_tables_show_the_columns_their_rows_have():
    results = _results() + passing_results()
    text = render_markdown(ENVIRONMENT, results, evaluate(results))
    llm_forward = _section(text, "llm · prefill · forward")
    header = "| case | kept | method | ms | TFLOP/s | vs cuDNN | peak GiB | time / flash-dma | setup s | note |"
    assert header in llm_forward
    assert "| S=4096 keep=1/4 | 8/32 | flex | 0.1 | 100 |  | 1 | 2.00x | 0.5 |  |" in llm_forward
    assert "| S=4096 keep=1/4 | 8/32 | flash-dma | 0.05 | 350 |  | 0.0625 |  | 0.5 |  |" in llm_forward
    assert "| sdpa-additive |  |  |  |  |  |  | skipped: OutOfMemoryError: CUDA out of memory |" in llm_forward
    # vs cuDNN: the row's TFLOP/s over sdpa-cudnn's on the same suite, shape, S and pass.
    assert "| S=16384 keep=1 | 128/128 | flash-dma | 1.6 | 600 | 1.09x |" in llm_forward
    assert "| S=16384 keep=1/8 | 16/128 | flex | 1 | 100 | 0.18x |" in llm_forward
    assert "| S=16384 keep=1 | all | sdpa-cudnn | 1.72 | 550 | 1.00x |" in llm_forward
    assert "| S=131072 keep=1/8 | 128/1024 | flex | 1 | 100 |  |" in llm_forward  # no cuDNN row at 128K here
    decode = _section(text, "seed · decode · forward")
    assert "| ms | TFLOP/s | GB/s | peak GiB |" in decode and "vs cuDNN" not in decode
    assert "| Sk=524288 keep=1/8 | 512/4096 | flash-dma | 0.02 | 100 | 840 | 1 |" in decode
    assert "GB/s" not in llm_forward  # bandwidth only where rows have it (decode)

    # The SM clock column only where a row of the table was sampled.
    llm_step = _section(text, "llm · prefill · forward + backward")
    assert "| setup s | SM clock | note |" in llm_step and "SM clock" not in llm_forward
    assert "| S=4096 keep=1/4 | 8/32 | flash-dma | 0.4 |" in llm_step and "| 1800-1815 MHz (power cap) |  |" in llm_step

    token = _section(text, "token · prefill · forward")
    assert "| S=16384 top-2048 keys | 2048/16384 keys | flex | 1 | 100 | 1 | 10.00x |" in token
    assert "| S=16384 bias only | all | flash-dma | 1 |" in token
    assert "| S=16384 keep=1/8 per q-block | 16/128 per q-block | flex | 4 |" in text

    host = _section(text, "host · host time per call · forward + backward")
    assert "| case | kept | method | µs/call | CPU µs/call | setup s | note |" in host
    assert "| S=128 top-128 keys | 128/128 keys | flash-dma | 100 | 90.0 | 0.5 |  |" in host
    llama = _section(text, "llama · train step · forward + backward")
    assert "transformers Llama, 4 layers, hidden 2048" in llama
    assert "| S=16384 train step | all | llama-sdpa | 60.0 | 1 | 1.20x | 0.5 |  |" in llama
    first = _section(text, "firstcall · prefill · forward + backward")
    assert "| case | kept | method | first call s | setup s | note |" in first
    assert "| S=4096 keep=1/8, new process, cold caches | 4/32 | flash-dma-percall | 4 | 3.0 |  |" in first
    assert "| prompt=128 generate 8, new process, warm cache | all | llama-flash-dma | 3 | 6.0 |  |" in text


def test_new_suites_tables():
    results = passing_results()
    text = render_markdown(ENVIRONMENT, results, evaluate(results))
    varlen = _section(text, "varlen · prefill · forward + backward")
    assert "8 documents packed (lengths " in varlen
    assert "| time / flash-dma-varlen |" in varlen
    assert "| S=32768 8 docs keep=1/8 | 34/260 per doc | flash-dma-padded | 2.5 | 100 | 1 | 1.67x |" in varlen
    # The kvcache suite has two shapes: a table each, under one heading.
    kvcache = _section(text, "kvcache · decode · forward")
    b8, b1 = kvcache.split("B=8 H=32 Hkv=8 D=128, bf16, causal.")[1].split("B=1 H=2 Hkv=1 D=64, bf16, causal.")
    assert "| Sk=32768 keep=1/8 random paged 256 | 4096/32768 keys | flash-dma-kvcache | 0.052 | 100 | 2900 |" in b8
    assert "| Sk=524288 keep=1/8 random contiguous | 65536/524288 keys | flash-dma-kvcache | 0.01 | 100 | 1750 |" in b1
    assert "Sk=524288" not in b8


def test_targets_of_suites_not_run_are_not_reported():
    llm_only = [r for r in passing_results() if r.case.suite == "llm"]
    text = render_markdown(ENVIRONMENT, llm_only, evaluate(llm_only))
    targets = _section(text, "Targets")
    assert "NO DATA" not in targets and "seed " not in targets and "kvcache" not in targets
    assert f"17 of the {len(TARGETS)} targets concern the rows of this run" in targets
    assert targets.count("**PASS**") == 17
    assert f"All {len(TARGETS)} targets concern" in render_markdown(ENVIRONMENT, [], evaluate(passing_results()))

