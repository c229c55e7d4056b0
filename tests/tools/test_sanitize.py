"""tools/sanitize.py and its driver: the log parser, the sanitizer's command line, and a whole run
with a stand-in sanitizer (the cases then run under the Triton interpreter on the CPU)."""

import argparse
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

from flash_dma.backends.triton.launch import Launcher, Prepared
from tools.sanitize import EXCLUDE_MANGLED, Run, parse_log, sanitizer_command, variant_coverage
from tools.sanitize_driver import CASES, HOPPER_VARIANTS, MARK, Attention, Decode, Fp8, Topk, Varlen, launched_variants

REPO = Path(__file__).resolve().parents[2]

MEMCHECK_LOG = """\
[sanitize-driver] begin attn-len1
========= COMPUTE-SANITIZER
[sanitize-driver] end attn-len1 ok (0.50s)
[sanitize-driver] begin decode-paged-splits
========= Invalid __global__ read of size 2 bytes
=========     at _attn_fwd_kernel+0x1c70 in /repo/flash_dma/backends/triton/tiles.py:212
=========     by thread (33,0,0) in block (0,1,2)
=========     Address 0x7f0c5e000a00 is out of bounds
=========
========= Invalid __global__ read of size 2 bytes
=========     at _attn_fwd_kernel+0x1c70 in /repo/flash_dma/backends/triton/tiles.py:212
=========     by thread (34,0,0) in block (0,1,2)
=========
========= Program hit cudaErrorLaunchFailure (error 719) due to "unspecified launch failure" on CUDA API call to \
cuStreamSynchronize.
=========     Saved host backtrace up to driver entry point at error
=========
[sanitize-driver] end decode-paged-splits FAILED: RuntimeError: CUDA error: unspecified launch failure (0.90s)
[sanitize-driver] 1 passed, 1 failed
========= ERROR SUMMARY: 3 errors
"""

RACECHECK_LOG = """\
[sanitize-driver] begin summary-key-list
========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at _key_list_kernel+0x3a0 in key_list.py:70
=========     and Read access at _key_list_kernel+0x410 in key_list.py:72 [128 hazards]
=========
========= Warning: Race reported between Write access at _key_list_kernel+0x500 in key_list.py:75
=========     and Write access at _key_list_kernel+0x520 in key_list.py:75 [4 hazards]
=========
[sanitize-driver] end summary-key-list ok (3.10s)
========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)
"""


def test_memcheck_reports_are_grouped_and_attributed_to_their_case():
    report = parse_log(MEMCHECK_LOG)
    assert report.errors == report.total_errors == 3
    assert report.passed == ["attn-len1"] and list(report.failed) == ["decode-paged-splits"]
    invalid, api = report.findings
    assert (invalid.text, invalid.count) == ("Invalid __global__ read of size 2 bytes", 2)
    assert invalid.case == "decode-paged-splits"
    assert invalid.where == "at _attn_fwd_kernel+0x1c70 in /repo/flash_dma/backends/triton/tiles.py:212"
    assert api.text.startswith("Program hit cudaErrorLaunchFailure") and (api.where, api.count) == ("", 1)


def test_racecheck_summary_counts_errors_and_warnings():
    report = parse_log(RACECHECK_LOG)
    assert (report.errors, report.race_errors, report.race_warnings, report.total_errors) == (None, 1, 1, 1)
    error, warning = report.findings
    assert error.text.startswith("Error: Race reported between Write access at _key_list_kernel+0x3a0")
    assert error.where == "and Read access at _key_list_kernel+0x410 in key_list.py:72 [128 hazards]"
    assert warning.text.startswith("Warning:") and warning.case == "summary-key-list"


def test_a_run_fails_on_errors_timeouts_failed_cases_and_an_unseen_canary():
    def run(log: str, returncode: int | None, cases=("summary-key-list",), canary=False) -> str | None:
        result = Run("x", "racecheck", list(cases), Path("x.log"), expect_errors=canary, returncode=returncode)
        result.report = parse_log(log)
        return result.problem()

    clean = "[sanitize-driver] begin a\n[sanitize-driver] end a ok (1s)\n========= ERROR SUMMARY: 0 errors\n"
    assert run(clean, 0, ["a"]) is None
    assert run(RACECHECK_LOG, 86) == "1 errors"
    assert run(MEMCHECK_LOG, 86, canary=True) is None
    assert run(clean, 0, ["a"], canary=True) == "the deliberate out-of-bounds read was not reported"
    assert run("[sanitize-driver] begin a\n", None, ["a"]) == "timed out in case a"
    assert run("[sanitize-driver] begin a\n", 139, ["a"]).startswith("no error summary (exit status 139; last case a)")
    failed = "[sanitize-driver] end a FAILED: out: 3 non-finite values (1s)\n========= ERROR SUMMARY: 0 errors\n"
    assert run(failed, 1, ["a"]) == "1 cases failed their checks"


def test_command_uses_the_options_this_sanitizer_has():
    options = argparse.Namespace(print_limit=20, all_kernels=False)
    new = sanitizer_command("cs", "racecheck", ["a", "b"], options, "--kernel-name-exclude ... --check-exit-code")
    assert new[:4] == ["cs", "--tool=racecheck", "--error-exitcode=86", "--print-limit=20"]
    wanted = {"--check-exit-code=no", f"--kernel-name-exclude={EXCLUDE_MANGLED}", "--racecheck-report=analysis"}
    assert wanted < set(new)
    assert new[-4:] == [sys.executable, str(REPO / "tools" / "sanitize_driver.py"), "--case=a", "--case=b"]
    old = sanitizer_command("cs", "memcheck", ["a"], options, "--kernel-regex-exclude")
    assert old[4] == f"--kernel-regex-exclude={EXCLUDE_MANGLED}" and old[5] == sys.executable
    every_kernel = argparse.Namespace(print_limit=0, all_kernels=True)
    assert sanitizer_command("cs", "memcheck", ["a"], every_kernel, "--kernel-name-exclude")[4] == sys.executable

def test_a_launch_specialised_as_a_hopper_variant_is_named_with_its_case(capsys):
    variant = next(v for v in HOPPER_VARIANTS if v.name == "forward-hopper-rows")
    names = variant.kernel.arg_names
    template = [variant.constexprs.get(name) for name in names]
    other = list(template)
    other[names.index("MASK")] += 1  # another mask form: no variant of this name
    prepared = iter([Prepared(variant.kernel, None, (1, 1, 1), t, [], {}) for t in (template, other)])
    with mock.patch.object(Launcher, "prepare", lambda *args: next(prepared)), launched_variants(lambda: "the-case"):
        variant.launcher.prepare(None, [], (), None)
        variant.launcher.prepare(None, [], (), None)
    named, unnamed = capsys.readouterr().out.splitlines()
    assert named == f"{MARK} variant forward-hopper-rows the-case"
    assert unnamed.startswith(f"{MARK} unnamed {variant.kernel.__name__} the-case ") and " MASK=3," in unnamed


def test_variant_lines_are_gathered_and_the_variants_no_case_launches_listed():
    report = parse_log(
        f"{MARK} begin a\n{MARK} variant {HOPPER_VARIANTS[0].name} a\n{MARK} end a ok (1.0s)\n"
        f"{MARK} begin b\n{MARK} variant {HOPPER_VARIANTS[0].name} b\n{MARK} unnamed _k b MASK=1,BIAS=3\n"
        f"{MARK} end b ok (1.0s)\n"
    )
    assert report.variants == {HOPPER_VARIANTS[0].name: ["a", "b"]} and report.passed == ["a", "b"]
    assert report.unnamed == {"_k MASK=1,BIAS=3": ["b"]}
    section = variant_coverage(report.variants, report.unnamed)
    assert section[2].startswith(f"1 of the {len(HOPPER_VARIANTS)} Hopper variants")
    not_launched = section[2].split("not launched: ")[1].rstrip(".").split(", ")
    assert not_launched == [v.name for v in HOPPER_VARIANTS[1:]]
    assert section[-5] == f"| {HOPPER_VARIANTS[0].name} | a, b |" and section[-1] == "- `_k MASK=1,BIAS=3`: b"


def test_the_cases_cover_odd_shapes():
    specs = [getattr(case.run, "__self__", None) for case in CASES.values()]
    attention = [spec for spec in specs if isinstance(spec, Attention)]
    assert {64, 72, 256} <= {spec.head_dim for spec in specs if isinstance(spec, (Attention, Varlen))}
    assert {1, 17, 129, 257} <= {spec.seqlen_k for spec in attention} | {spec.seqlen_q for spec in attention}
    assert {(4, 1), (4, 2)} <= {(spec.heads, spec.kv_heads) for spec in attention}
    splits = {bool(spec.page_size) for spec in specs if isinstance(spec, Decode) and spec.num_splits != 1}
    assert splits == {False, True}  # split-KV over contiguous and paged caches
    topk = [spec for spec in specs if isinstance(spec, Topk)]
    assert {spec.bias.count(",") for spec in topk} == {2, 3} and any(spec.hot for spec in topk)  # per key and per pair; shared keys
    assert {spec.walk for spec in topk} == {"indices", "union", "packed"}
    fp8 = [spec for spec in specs if isinstance(spec, Fp8)]
    assert {spec.head_dim for spec in fp8} == {64, 128, 256} and {"summary", "packed"} <= {spec.walk for spec in fp8}


def test_list_shows_every_case():
    listing = subprocess.run(
        [sys.executable, "tools/sanitize_driver.py", "--list"], cwd=REPO, capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    ).stdout
    assert [line.split()[0] for line in listing.splitlines()] == list(CASES)


FAKE_SANITIZER = '''#!{python}
"""Stands in for compute-sanitizer: runs the program after the options, then reports no error."""
import subprocess, sys

args = sys.argv[1:]
if args in (["--help"], ["--version"]):
    print("--kernel-name-exclude --check-exit-code" if args == ["--help"] else "Version 0 (stand-in)")
    sys.exit(0)
while args[0].startswith("--"):
    args = args[1:]  # the runner writes every option as --name=value
print("========= COMPUTE-SANITIZER", flush=True)
status = subprocess.call(args)
print("========= ERROR SUMMARY: 0 errors")
sys.exit(status)
'''


def test_a_whole_run_with_a_stand_in_sanitizer(tmp_path):
    sanitizer = tmp_path / "compute-sanitizer"
    sanitizer.write_text(FAKE_SANITIZER.format(python=sys.executable))
    sanitizer.chmod(0o755)
    out = tmp_path / "out" / "sanitize.md"
    result = subprocess.run(
        [sys.executable, "tools/sanitize.py", "--sanitizer", str(sanitizer), "--tools", "memcheck",
         "--cases", "attn-len1,summary-key-list", "--no-canary", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "TRITON_CACHE_DIR": str(tmp_path / "triton")},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = out.read_text()
    assert "| memcheck | 2 | 0 | - |" in summary and "| clean |" in summary
    log = (out.parent / "sanitize-memcheck.log").read_text()
    assert log.startswith(f"$ {sanitizer} --tool=memcheck ") and f"--kernel-name-exclude={EXCLUDE_MANGLED}" in log
    assert "[sanitize-driver] end attn-len1 ok" in log and "[sanitize-driver] end summary-key-list ok" in log
    assert "[sanitize-driver] end attn-len1 ok" in (out.parent / "sanitize-warmup.log").read_text()
