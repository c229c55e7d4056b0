"""Launching: every head dim fits the device, tuning is stored on disk, the direct launch path
takes the right compiled kernel whatever the strides and alignment of its inputs, and a call's
kernels are compiled ahead, side by side, by a dry run of the call."""

import gc
import json
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl

from flash_dma import flash_dma_func, memo
from flash_dma.backends.triton import launch, layout
from flash_dma import build_block_mask
from tests.helpers import (
    DEVICE,
    KERNEL_DTYPES,
    Case,
    assert_close,
    assert_gradients_close,
    hopper_passes,
    make_inputs,
    reference_outputs,
    triton_call,
)


@pytest.fixture
def tuning(monkeypatch, tmp_path, request):
    """``FLASH_DMA_AUTOTUNE`` set as the test asks, tuning stored under ``tmp_path``, nothing chosen yet."""
    monkeypatch.setenv("FLASH_DMA_AUTOTUNE", "1" if request.param else "0")
    monkeypatch.setenv("FLASH_DMA_CACHE_DIR", str(tmp_path))
    launch.forget_choices()
    yield tmp_path
    launch.forget_choices()


@pytest.mark.gpu_only
@pytest.mark.parametrize("head_dims", [range(start, start + 32) for start in range(1, 257, 32)], ids=lambda r: f"D{r.start}-{r.stop - 1}")
@pytest.mark.parametrize("tuning", [False, True], ids=["shipped", "autotune"], indirect=True)
def test_every_head_dim_fits_shared_memory(tuning, head_dims):
    """No configuration may exceed the device's shared memory, whichever path picks it."""
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    for head_dim in head_dims:
        q = torch.randn(1, 64, 4, head_dim, generator=gen).to(DEVICE, dtype).requires_grad_()
        k, v = (torch.randn(1, 64, 1, head_dim, generator=gen).to(DEVICE, dtype).requires_grad_() for _ in range(2))
        out = flash_dma_func(q, k, v, is_causal=True)
        out.sum().backward()
        one = flash_dma_func(q[:, :1], k[:, :1], v[:, :1], window_size=(1000, 0))  # a decode-sized call
        assert out.isfinite().all() and one.isfinite().all() and q.grad.isfinite().all(), head_dim
    if tuning.exists() and any(tuning.iterdir()):
        stored = [json.loads(path.read_text()) for path in tuning.iterdir()]
        assert all(entry for entry in stored)


@pytest.mark.gpu_only
@pytest.mark.parametrize("tuning", [True], ids=["autotune"], indirect=True)
def test_tuning_is_stored_and_read_back(tuning):
    # D = 40: the Triton forward, which has candidates to tune (on sm90 the Hopper forward takes
    # D = 64 and 128, with a single configuration).
    case = Case(batch=1, seqlen_q=256, seqlen_k=256, heads=4, kv_heads=2, head_dim=40, causal=True)
    inputs = make_inputs(case, torch.bfloat16)
    first = flash_dma_func(**inputs, is_causal=True)
    files = list(tuning.iterdir())
    assert files, "the tuned choice was written to the cache directory"
    launch.forget_choices()  # a new process: choices come from disk, and nothing is timed again
    assert torch.equal(flash_dma_func(**inputs, is_causal=True), first)


@pytest.mark.gpu_only
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "in-order"])
@pytest.mark.parametrize("tuning", [True], ids=["autotune"], indirect=True)
def test_autotuning_leaves_the_first_backward_exact(tuning, deterministic, monkeypatch):
    """Tuning times the dK/dV candidates on the call's own buffers, query chunks' scratch and
    counters included: they must be cleared before the real launch."""
    from flash_dma.backends.triton import backward

    monkeypatch.setattr(backward, "query_chunks", lambda *problem: 3)
    case = Case(batch=1, seqlen_q=256, seqlen_k=256, heads=4, kv_heads=2, head_dim=64, mask="B,Hkv,1,Sk", bias="1,Hkv,1,Sk", causal=True)
    inputs = make_inputs(case, torch.bfloat16, requires_grad=True)
    out = flash_dma_func(**inputs, is_causal=True, deterministic=deterministic)
    dout = torch.randn_like(out)
    out.backward(dout)
    _, _, oracle = reference_outputs(case, inputs, dout, torch.float64)
    _, _, baseline = reference_outputs(case, inputs, dout, torch.bfloat16)
    assert_gradients_close(inputs, oracle, baseline)


@pytest.mark.parametrize("head_dim", [64, 40], ids=lambda d: f"D{d}")
def test_inputs_of_any_alignment_and_stride(head_dim):
    """Alternating calls whose strides and pointers Triton specialises differently must each
    run their own compiled kernel (the launcher keys its cache on what Triton specialises)."""
    dtype = KERNEL_DTYPES[0]
    case = Case(batch=2, seqlen_q=70, seqlen_k=90, heads=4, kv_heads=2, head_dim=head_dim, mask="B,Hkv,1,Sk", bias="1,H,1,Sk", causal=True)
    inputs = make_inputs(case, dtype)
    oracle, _, _ = reference_outputs(case, inputs, None, torch.float64)
    baseline, _, _ = reference_outputs(case, inputs, None, dtype)
    q = inputs["query"]
    wide = torch.zeros(*q.shape[:3], head_dim + 3, dtype=dtype, device=DEVICE)
    strided = wide[..., :head_dim].copy_(q)  # odd row strides
    buffer = torch.zeros(q.numel() + 1, dtype=dtype, device=DEVICE)
    misaligned = buffer[1:].view(q.shape).copy_(q)  # a pointer off 16-byte alignment
    for query in (strided, q, misaligned, q, strided):
        out = flash_dma_func(**{**inputs, "query": query}, is_causal=True, backend="triton")
        assert_close("out", out, oracle, baseline)
    # Another input misaligned instead, on the same layout: its own compiled kernel, not q's.
    k = inputs["key"]
    key_buffer = torch.zeros(k.numel() + 1, dtype=dtype, device=DEVICE)
    misaligned_key = key_buffer[1:].view(k.shape).copy_(k)
    for query, key in ((misaligned, k), (q, misaligned_key)):
        out = flash_dma_func(**{**inputs, "query": query, "key": key}, is_causal=True, backend="triton")
        assert_close("out", out, oracle, baseline)


@pytest.mark.parametrize("tma", ["1", "0"], ids=["tma", "row-loads"])
def test_tma_and_row_loads_give_the_same_gradients(monkeypatch, tma):
    """Both ways of loading tiles (TMA descriptors where allowed, ``FLASH_DMA_TMA=0`` never) pass
    the oracle, for block-listed, dense and per-key-mask walks of the forward and dQ kernels."""
    monkeypatch.setenv("FLASH_DMA_TMA", tma)
    monkeypatch.setattr(layout, "TMA_MIN_KEYS", 0)  # TMA pays from 16K keys on; here, test it small
    launch.forget_choices()
    dtype = KERNEL_DTYPES[0]
    case = Case(batch=1, seqlen_q=70, seqlen_k=90, heads=4, kv_heads=2, head_dim=96, mask="1,Hkv,1,Sk", bias="1,Hkv,1,Sk", causal=True)
    inputs = make_inputs(case, dtype, requires_grad=True)
    dout = torch.randn(inputs["query"].shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    oracle_out, _, oracle = reference_outputs(case, inputs, dout, torch.float64)
    baseline_out, _, baseline = reference_outputs(case, inputs, dout, dtype)
    for block_mask in (None, build_block_mask(inputs["attn_mask"], block_size=(32, 32))):
        out = flash_dma_func(**inputs, is_causal=True, block_mask=block_mask, backend="triton")
        assert_close("out", out, oracle_out, baseline_out)
        for leaf in ("query", "key", "value", "attn_bias"):
            inputs[leaf].grad = None
        out.backward(dout)
        assert_gradients_close(inputs, oracle, baseline)
    launch.forget_choices()


def test_tma_needs_aligned_rows_and_a_problem_where_it_pays(monkeypatch):
    copy_engine_reads = layout.copy_engine_reads
    monkeypatch.setenv("FLASH_DMA_TMA", "1")
    rows = torch.zeros(2, 8, 3, 128, dtype=KERNEL_DTYPES[0], device=DEVICE)
    expected = DEVICE.type == "cpu" or torch.cuda.get_device_capability()[0] >= 9
    assert copy_engine_reads(128, 16384, rows) == expected
    assert not copy_engine_reads(64, 16384, rows)  # measured slower at D = 64
    assert not copy_engine_reads(128, 4096, rows)  # and at 4K keys
    odd_stride = torch.zeros(2, 8, 3, 129, dtype=KERNEL_DTYPES[0], device=DEVICE)[..., :128]
    assert not copy_engine_reads(128, 16384, odd_stride)
    misaligned = torch.zeros(2 * 8 * 3 * 128 + 1, dtype=KERNEL_DTYPES[0], device=DEVICE)[1:].view(2, 8, 3, 128)
    assert not copy_engine_reads(128, 16384, misaligned)
    monkeypatch.setenv("FLASH_DMA_TMA", "0")
    assert not copy_engine_reads(128, 16384, rows)


def test_memoised_plans_are_bounded_and_keep_no_tensor(monkeypatch):
    """What a layout decides is remembered per layout (``flash_dma.memo``): in bounded memos that
    hold no tensor, so that no call's inputs or outputs outlive it."""
    monkeypatch.setattr(memo, "MAX_ENTRIES", 2)
    memo.forget_memos()  # those of earlier tests: each memo is cut back when it next remembers
    alive = []
    for seqlen in (17, 18, 19, 20):
        case = Case(batch=1, seqlen_q=seqlen, seqlen_k=seqlen, heads=2, kv_heads=1, head_dim=16, mask="1,1,1,Sk", bias="1,1,1,Sk", causal=True)
        inputs = make_inputs(case, KERNEL_DTYPES[0], requires_grad=True)
        out = flash_dma_func(**inputs, is_causal=True, backend="triton")
        out.sum().backward()
        alive += [weakref.ref(t) for t in (*inputs.values(), out)]
        del inputs, out
    assert all(len(m) <= 2 for m in memo._MEMOS)
    gc.collect()
    assert all(ref() is None for ref in alive)


@pytest.mark.gpu_only
def test_a_compiled_kernel_serves_only_its_own_constexprs():
    """Launches that differ only in constexprs (the block size, the reduction) each get their own
    compiled kernel: one built for blocks of 16 would read blocks of 32 wrongly."""
    from flash_dma.backends.triton.block_topk import block_topk_state

    bias = torch.randn(1, 2, 1, 320, device=DEVICE)
    for block, mean in ((16, False), (32, False), (32, True)):
        blocks = bias.view(1, 2, 1, -1, block)
        scores = blocks.mean(-1) if mean else blocks.amax(-1)
        expected = torch.zeros_like(scores, dtype=torch.int8).scatter_(-1, scores.topk(3, dim=-1).indices, 2)
        assert torch.equal(block_topk_state(bias, None, None, block, 3, 0, mean), expected), (block, mean)


# -- compiling ahead (launch.py's module doc) -------------------------------------------------

AHEAD_CASES = [
    # A per-key mask made into a key list, and a per-pair one walked by a summary built per call.
    Case(batch=1, seqlen_q=70, seqlen_k=70, heads=4, kv_heads=2, head_dim=16, mask="1,Hkv,1,Sk", bias="1,Hkv,1,Sk", causal=True, listed=True),
    Case(seqlen_q=40, seqlen_k=90, heads=4, kv_heads=2, head_dim=16, mask="B,Hkv,Sq,Sk", bias="1,H,Sq,Sk", listed=True),
    Case(seqlen_q=70, seqlen_k=70, heads=2, kv_heads=1, head_dim=32, mask="1,1,Sq,Sk", packed=True, block_size=(32, 32), causal=True),
    Case(seqlen_q=70, seqlen_k=70, heads=2, kv_heads=1, head_dim=32, causal=True),
]


@pytest.fixture
def backend_calls(monkeypatch):
    """The problems the Triton backend's entry point receives, each with the number of launches
    run before it (on a GPU, ``pack_mask`` launches kernels of its own before the call), and the
    kernels each launch runs."""
    import flash_dma.backends.triton as triton_backend

    problems, launched = [], []
    entry, run = triton_backend.attention, launch.Prepared.run
    monkeypatch.setattr(triton_backend, "attention", lambda problem: problems.append((problem, len(launched))) or entry(problem))
    monkeypatch.setattr(launch.Prepared, "run", lambda self, *tensors: launched.append(self.kernel.__name__) or run(self, *tensors))
    return problems, launched


@pytest.mark.parametrize("case", AHEAD_CASES, ids=str)
def test_a_dry_run_reaches_every_launch_of_the_call_and_runs_none(case, backend_calls):
    """The call's dry run goes through its forward's and its backward's host code: it reaches the
    launches that the call itself makes, in order, and launches none of them."""
    import flash_dma.backends.triton as triton_backend

    problems, launched = backend_calls
    inputs = make_inputs(case, KERNEL_DTYPES[0], requires_grad=True)
    triton_call(case, inputs).sum().backward()
    (problem, first), = problems
    calls = launched[first:]  # the call's own: from its entry point on, its backward's included
    small = triton_backend.SMALL_PROBLEM
    triton_backend.SMALL_PROBLEM = 0 if case.listed else small  # as triton_call had it
    try:
        with launch.dry_run() as launches:
            triton_backend.dry_attention(problem, True)
        with launch.dry_run() as forward_launches:
            triton_backend.dry_attention(problem, False)  # no backward without grad mode
    finally:
        triton_backend.SMALL_PROBLEM = small
    # The backward's dQ pass is reached, on the Triton kernel or (on sm90) the Hopper one.
    assert [name for name, _ in launches] == calls and {"_dq_kernel", "_dq_hopper_kernel"} & {*calls}
    assert launched[first:] == calls  # nothing ran in the dry runs
    # Nothing to compile: the call compiled every kernel (the interpreter compiles none).
    assert all(compilation is None for _, compilation in launches)
    assert [name for name, _ in forward_launches] == calls[: calls.index("_preprocess_kernel")]


@pytest.mark.parametrize("made", ["key-list", "intervals"])
def test_what_a_dry_run_derives_is_never_reused(made, poison_outputs, monkeypatch):
    """A dry run's tensors are never written (here: NaN or the largest int), so what it makes of a
    mask (a per-key mask's key list, a KeyIntervals' rows as the kernels read them) must not be kept for the mask's next
    call (``memo.DRY_RUN``)."""
    import flash_dma.backends.triton as triton_backend
    from flash_dma import interval_mask
    from flash_dma.backends.triton import key_intervals
    from flash_dma.inputs import normalize_inputs

    monkeypatch.setattr(triton_backend, "SMALL_PROBLEM", 0)
    case = Case(batch=1, seqlen_q=70, seqlen_k=70, heads=4, kv_heads=2, head_dim=16, mask="1,Hkv,1,Sk", bias="1,Hkv,1,Sk", causal=True)
    inputs = make_inputs(case, KERNEL_DTYPES[0])
    if made == "intervals":  # each key seen by the rows [key // 2, 70)
        ends = torch.full((1, 2, 70), 70, dtype=torch.int32, device=DEVICE)
        starts = torch.arange(70, dtype=torch.int32, device=DEVICE).div(2, rounding_mode="floor").expand(1, 2, 70).contiguous()
        intervals = interval_mask(ends, starts, query_len=70, block_size=(32, 32))
        inputs["attn_mask"] = intervals
    problem = normalize_inputs(*inputs.values(), is_causal=True, descales=(None, None, None))
    memos = (len(triton_backend._DERIVED), len(key_intervals._KERNEL_ROWS))
    with launch.dry_run() as launches:
        triton_backend.dry_attention(problem, False)
    assert "_key_list_kernel" in [name for name, _ in launches] or made == "intervals"
    assert (len(triton_backend._DERIVED), len(key_intervals._KERNEL_ROWS)) == memos
    out = flash_dma_func(**inputs, is_causal=True, backend="triton")
    dense = {**inputs, "attn_mask": intervals.dense()} if made == "intervals" else inputs
    oracle, _, _ = reference_outputs(case, dense, None, torch.float64)
    baseline, _, _ = reference_outputs(case, dense, None, KERNEL_DTYPES[0])
    assert_close("out", out, oracle, baseline)


@triton.jit
def _doubled_kernel(X, Y, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offsets, 2 * tl.load(X + offsets, mask=offsets < n), mask=offsets < n)


@pytest.fixture
def compiling_pool(monkeypatch):
    """Launchers that compile as on a GPU, on a pool of two threads, with stand-ins for Triton's
    compilation: ``on_pool`` lists each kernel compiled on the pool (name, arguments), and a
    compilation by the call fails. Every choice is forgotten before and after."""
    pool = ThreadPoolExecutor(2)
    compiled = SimpleNamespace(metadata=SimpleNamespace(global_scratch_size=0))
    on_pool = []

    def compile_on_pool(self, args, key, configs):
        on_pool.append((self.kernel.__name__, args))
        return compiled, configs[0]

    monkeypatch.setattr(launch, "triton_interpreting", lambda: False)
    hashed = pool.submit(lambda: None)
    monkeypatch.setattr(launch, "_pool", lambda: launch._Compilers(pool, hashed))
    monkeypatch.setattr(launch.Launcher, "_compile_on_pool", compile_on_pool)
    monkeypatch.setattr(launch.Launcher, "_compile", lambda *_: pytest.fail("the call compiled a kernel itself"))
    launch.forget_choices()
    yield SimpleNamespace(compiled=compiled, on_pool=on_pool)
    launch.forget_choices()  # the plans made here hold the stand-in kernel
    pool.shutdown()


def _doubled_launch():
    """A launcher of ``_doubled_kernel`` and its launch's ``(tensors, build, candidates, grid)``."""
    launcher = launch.Launcher(_doubled_kernel, tensors=("X", "Y"), specialized=("n",))
    x, y = torch.ones(64, device=DEVICE), torch.empty(64, device=DEVICE)
    args = [x, y, 64, 32]
    return launcher, ([x, y], lambda: (args, ("doubled",)), lambda: [triton.Config({}, num_warps=4, num_stages=1)], lambda meta: (2,))


def test_a_launch_takes_the_kernel_its_dry_run_started(compiling_pool):
    """A dry run hands each kernel to the pool once, without its tensors (only what Triton
    specialises on), and the launch that needs it waits for it instead of compiling its own."""
    launcher, (tensors, build, candidates, grid) = _doubled_launch()
    with launch.dry_run() as launches:
        launcher.launch("layout", tensors, build, candidates, grid)
        launcher.launch("layout", tensors, build, candidates, grid)  # compiling already: nothing more
    (name, first), (_, second) = launches
    assert name == "_doubled_kernel" and first is second and first.result()[0] is compiling_pool.compiled
    ((_, arguments),) = compiling_pool.on_pool
    assert not any(isinstance(a, torch.Tensor) for a in arguments)
    assert [(a.dtype, a.device, a.data_ptr()) for a in arguments[:2]] == [(t.dtype, t.device, t.data_ptr() % 16) for t in tensors]
    prepared = launcher.prepare(grid, *build(), candidates)
    assert prepared.compiled is compiling_pool.compiled and launcher.pending == {}


def test_a_kernel_that_failed_on_the_pool_is_compiled_by_its_call(compiling_pool, monkeypatch):
    """A failure on the pool is not the call's: the call compiles the kernel again, and a genuine
    error then comes from its own compilation."""
    own = SimpleNamespace(metadata=SimpleNamespace(global_scratch_size=0))
    monkeypatch.setattr(launch.Launcher, "_compile_on_pool", lambda *_: (_ for _ in ()).throw(RuntimeError("on the pool")))
    monkeypatch.setattr(launch.Launcher, "_compile", lambda self, grid, args, key, candidates: (own, candidates()[0]))
    launcher, (tensors, build, candidates, grid) = _doubled_launch()
    with launch.dry_run():
        launcher.launch("layout", tensors, build, candidates, grid)
    assert launcher.prepare(grid, *build(), candidates).compiled is own and launcher.pending == {}


def test_front_ends_take_turns_and_keep_the_cache_key():
    """A kernel's source class runs its front end (``make_ir``) in its turn; the source's hash, and
    so Triton's cache key, is unchanged. Made after the kernel's binder (which names the source
    class anew) and once per kernel; the interpreter's kernel has neither and is left alone."""
    from collections import defaultdict

    from triton.compiler import ASTSource as plain
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    kernel = JITFunction(_doubled_kernel.fn)
    # Triton's binder as made without a GPU: it names the source class, as the real one does.
    kernel.device_caches = defaultdict(lambda: setattr(kernel, "ASTSource", plain))
    launch.front_ends_in_turn(kernel, 0)
    launch.front_ends_in_turn(kernel, 0)
    assert kernel.ASTSource.__mro__[1:] == (launch._FrontEndInTurn, plain, *plain.__mro__[1:])
    signature = {"X": "*fp32", "Y": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    made = [source(kernel, signature, {(3,): 32}, {}) for source in (plain, kernel.ASTSource)]
    assert made[0].hash() == made[1].hash()
    interpreted = InterpretedFunction(_doubled_kernel.fn)
    launch.front_ends_in_turn(interpreted, 0)
    assert not hasattr(interpreted, "ASTSource")


def test_compilations_take_turns_until_their_front_ends_end_gluon_kernels_first(monkeypatch):
    """The pool's compilations run one at a time from their start to the end of their front end
    (the Python before it included), by rank (Gluon kernels first), then in the order they were
    handed to the pool; one that ends without a front end (a cached kernel) holds no later one up,
    and a front end off the pool takes a free turn."""
    import threading
    import time

    front_ends = launch._FrontEnds()
    monkeypatch.setattr(launch, "_FRONT_ENDS", front_ends)
    spans, starts, lock, gate = [], {}, threading.Lock(), threading.Event()

    def span(name):
        with lock:
            spans.append((starts.get(name, 0.0), time.perf_counter(), name))

    class Slow:
        def make_ir(self, name):
            starts.setdefault(name, time.perf_counter())  # off the pool, its turn starts here
            time.sleep(0.02)
            span(name)  # the front end's end: the turn passes on after it

    source = launch._in_turn(Slow)()

    def compile_on_pool(name):
        if name == "gate":
            assert gate.wait(5)
            return
        starts[name] = time.perf_counter()
        time.sleep(0.02)  # the Python before the front end: in the turn too
        if name == "cached":
            span(name)
        else:
            source.make_ir(name)

    ranked = [(1, "helper 1"), (1, "cached"), (0, "gluon 1"), (1, "helper 2"), (0, "gluon 2")]
    with ThreadPoolExecutor(len(ranked) + 1) as threads:
        futures = [front_ends.submit(threads, 1, compile_on_pool, "gate")]  # holds the first turn
        futures += [front_ends.submit(threads, rank, compile_on_pool, name) for rank, name in ranked]
        deadline = time.monotonic() + 5
        while len(front_ends._queued) < len(futures) and time.monotonic() < deadline:
            time.sleep(0.005)  # every compilation started and queued for its turn
        gate.set()
        source.make_ir("off the pool")
        for future in futures:
            future.result(timeout=5)
    spans.sort()
    assert all(end <= next_start for (_, end, _), (next_start, _, _) in zip(spans, spans[1:])), spans
    on_pool = [name for _, _, name in spans if name != "off the pool"]
    assert on_pool == ["gluon 1", "gluon 2", "helper 1", "cached", "helper 2"]
    assert front_ends._queued == []


def test_a_launcher_ranks_gluon_kernels_first():
    from flash_dma.backends.triton.hopper.forward import hopper_launcher
    from flash_dma.backends.triton.key_list import count_launcher

    assert (hopper_launcher.compile_rank, count_launcher.compile_rank) == (0, 1)


@pytest.mark.parametrize("ending", ["cancelled", "failed", "no front end"])
def test_a_compilation_that_never_reaches_its_front_end_holds_no_later_one_up(monkeypatch, ending):
    """A turn is given up however its compilation ends, so that a later compilation of the pool
    still gets its turn: one left queued (a failed compilation's, say) would hold it up for good;
    one cancelled before it started never queued."""
    import threading

    front_ends = launch._FrontEnds()
    monkeypatch.setattr(launch, "_FRONT_ENDS", front_ends)

    class Source:
        def make_ir(self):
            return "ir"

    source, started = launch._in_turn(Source)(), threading.Event()

    def compile_on_pool(kind):
        if kind == "blocker":
            started.wait(5)
        elif kind == "failed":
            raise RuntimeError("a compilation error")
        elif kind == "front end":
            return source.make_ir()

    with ThreadPoolExecutor(1) as threads:
        blocker = front_ends.submit(threads, 1, compile_on_pool, "blocker")  # keeps the one thread busy
        earlier = front_ends.submit(threads, 0, compile_on_pool, ending)
        later = front_ends.submit(threads, 1, compile_on_pool, "front end")
        if ending == "cancelled":
            assert earlier.cancel()
        started.set()
        try:
            assert later.result(timeout=5) == "ir" and blocker.result() is None
            assert front_ends._queued == []
        finally:  # on a failure, a later compilation still waiting is let go, so that the pool can shut down
            with front_ends._changed:
                front_ends._queued.clear()
                front_ends._running = False
                front_ends._changed.notify_all()


def test_a_forked_child_waits_for_no_ticket_of_its_parents_compilations(monkeypatch):
    """A compilation in flight when the process forks never runs in the child: the child's own
    compilations on the pool still get their turns."""
    import os
    import threading

    front_ends = launch._FrontEnds()
    monkeypatch.setattr(launch, "_FRONT_ENDS", front_ends)

    def front_end():
        with launch._FRONT_ENDS.turn():
            return "ir"

    started, release = threading.Event(), threading.Event()
    with ThreadPoolExecutor(1) as threads:
        front_ends.submit(threads, 0, lambda: started.set() or release.wait(5))  # its turn is held at the fork
        assert started.wait(5)
        child = os.fork()
        if child == 0:  # only os._exit leaves the child (joining no thread): no pytest machinery runs in it
            try:
                compiled = launch._FRONT_ENDS.submit(ThreadPoolExecutor(1), 1, front_end).result(timeout=5)
                os._exit(0 if compiled == "ir" else 1)
            except BaseException:
                os._exit(2)
        release.set()
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("not_specialized", [None, ["n"], [2]], ids=["none", "named", "numbered"])
def test_a_launcher_reads_its_kernel_compiled_or_interpreted(not_specialized):
    """Triton's jit function keeps ``do_not_specialize`` as a list (empty when none) and the
    interpreter's keeps the decorator's arguments: a launcher classifies the ints of either alike."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    specialized = () if not_specialized else ("n",)
    expected = ([], [2]) if not_specialized else ([2], [])
    for kind in (JITFunction, InterpretedFunction):
        kernel = kind(_doubled_kernel.fn, do_not_specialize=not_specialized)
        launcher = launch.Launcher(kernel, tensors=("X", "Y"), specialized=specialized)
        assert (launcher.int_slots, launcher.other_int_slots, launcher.constexpr_slots) == (*expected, [3]), kind.__name__


def test_a_dry_run_is_not_counted_as_the_calls_hopper_launches(compiling_pool, monkeypatch):
    """``hopper_passes`` (the Hopper tests' record of the kernels a call ran) counts the call's own
    launches: its dry run goes through the same host code, Hopper launches included, and launches none."""
    from flash_dma.backends.triton import backward, dispatch

    monkeypatch.setattr(launch, "compile_ahead_enabled", lambda: True)
    monkeypatch.setattr(launch.Prepared, "run", lambda self, *tensors: None)  # no GPU to run on
    # The backward routed to the Hopper kernels, stood in for by launches of nothing that list
    # what reached them: the call's and its dry run's.
    monkeypatch.setattr(backward, "route", lambda pass_, form: dispatch.HOPPER)
    reached = []
    for name in ("dkdv", "dq"):
        monkeypatch.setattr(backward, f"hopper_{name}", lambda *args, name=name: reached.append(name))
    taken = hopper_passes(monkeypatch, ("dkdv", "dq"))  # the forward takes whichever kernel this machine routes it to
    case = AHEAD_CASES[0]
    triton_call(case, make_inputs(case, KERNEL_DTYPES[0], requires_grad=True)).sum().backward()
    assert reached == ["dkdv", "dq"] * 2 and taken == ["dkdv", "dq"]


def test_a_call_starts_every_kernel_compiling_at_its_first_compilation(compiling_pool, monkeypatch):
    """End to end, on a layout never seen: the call's first launch that needs a kernel runs the
    call's dry run, once, which hands every kernel of the forward and the backward to the pool;
    each launch then takes its kernel from there. After the call the entry point has left nothing set."""
    monkeypatch.setattr(launch, "compile_ahead_enabled", lambda: True)
    dry_runs = []
    dry_run = launch.dry_run
    monkeypatch.setattr(launch, "dry_run", lambda: dry_runs.append(1) or dry_run())
    launched = []
    monkeypatch.setattr(launch.Prepared, "run", lambda self, *tensors: launched.append(self.kernel.__name__))  # no GPU to run on
    case = AHEAD_CASES[0]
    inputs = make_inputs(case, KERNEL_DTYPES[0], requires_grad=True)
    triton_call(case, inputs).sum().backward()
    assert [name for name, _ in compiling_pool.on_pool] == launched and len(launched) == 6
    assert dry_runs == [1] and launch.AHEAD.get() is None


@pytest.mark.gpu_only
def test_on_a_gpu_a_new_layout_compiles_on_the_pool_and_passes_the_oracle(monkeypatch):
    """On the GPU, every kernel that a call of a layout never seen needs, its backward's included,
    is compiled by the pool's threads (none by the call's own), and the call's results pass."""
    import threading

    monkeypatch.delenv("FLASH_DMA_COMPILE_AHEAD", raising=False)
    threads = []
    compile_kernel = launch.Launcher._compile
    monkeypatch.setattr(launch.Launcher, "_compile",
                        lambda self, *args: threads.append(threading.current_thread().name) or compile_kernel(self, *args))
    launch.forget_choices()
    case = Case(batch=1, seqlen_q=1000, seqlen_k=1000, heads=4, kv_heads=2, head_dim=64, mask="1,Hkv,1,Sk", bias="1,Hkv,1,Sk",
                causal=True, listed=True)
    inputs = make_inputs(case, torch.bfloat16, requires_grad=True)
    dout = torch.randn(inputs["query"].shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    try:
        out = triton_call(case, inputs)
        out.backward(dout)
    finally:
        launch.forget_choices()
    assert len(threads) >= 4 and all(name.startswith("flash-dma-compile") for name in threads), threads
    oracle_out, _, oracle = reference_outputs(case, inputs, dout, torch.float64)
    baseline_out, _, baseline = reference_outputs(case, inputs, dout, torch.bfloat16)
    assert_close("out", out, oracle_out, baseline_out)
    assert_gradients_close(inputs, oracle, baseline)


def test_compiling_ahead_is_on_unless_turned_off_or_autotuning(monkeypatch):
    from flash_dma.backends.triton import configs

    monkeypatch.setattr(configs, "triton_interpreting", lambda: False)
    monkeypatch.delenv("FLASH_DMA_AUTOTUNE", raising=False)
    monkeypatch.delenv("FLASH_DMA_COMPILE_AHEAD", raising=False)
    assert configs.compile_ahead_enabled()
    monkeypatch.setenv("FLASH_DMA_COMPILE_AHEAD", "0")
    assert not configs.compile_ahead_enabled()
    monkeypatch.setenv("FLASH_DMA_COMPILE_AHEAD", "1")
    monkeypatch.setenv("FLASH_DMA_AUTOTUNE", "1")  # candidates are timed on the call's own tensors
    assert not configs.compile_ahead_enabled()


class _Interpreter:
    """``sys``'s switch interval as CPython keeps it, in whole microseconds (1e-4 reads back as
    9.999...e-05), apart from the process's own: compilations on other threads change that."""

    def __init__(self):
        self.microseconds = 5000

    def getswitchinterval(self) -> float:
        return self.microseconds * 1e-6

    def setswitchinterval(self, seconds: float) -> None:
        self.microseconds = int(1e6 * seconds)


def test_the_switch_interval_is_set_back_when_the_last_compilation_ends(monkeypatch):
    interpreter = _Interpreter()
    monkeypatch.setattr(launch, "sys", interpreter)
    hand_offs = launch._QuickHandOffs()
    with hand_offs.held():
        with hand_offs.held():
            assert interpreter.microseconds == 100
        assert interpreter.microseconds == 100
    assert interpreter.microseconds == 5000
    with hand_offs.held():
        interpreter.setswitchinterval(0.002)  # someone else's choice, made meanwhile, is kept
    assert interpreter.microseconds == 2000


@pytest.mark.parametrize("ahead", [True, False], ids=["compiling-ahead", "not-compiling-ahead"])
def test_the_warm_up_runs_on_a_thread_of_its_own_that_a_fork_and_the_driver_wait_for(ahead, monkeypatch):
    done = []
    forks = []

    def warm_up():
        time.sleep(0.2)
        done.append(True)

    monkeypatch.setattr(launch, "compile_ahead_enabled", lambda: ahead)
    monkeypatch.setattr(launch, "_warm_up", warm_up)
    monkeypatch.setattr(launch.os, "register_at_fork", lambda before: forks.append(before))
    thread = launch._start_warm_up()
    if not ahead:  # nothing will compile ahead: no thread
        assert thread is None and forks == []
        return
    assert thread.daemon and forks == [thread.join] and done == []
    monkeypatch.setattr(launch, "_WARM_UP", thread)
    monkeypatch.setattr(launch.triton.runtime, "driver", SimpleNamespace(active="the driver"))
    assert launch._driver() == "the driver" and done == [True]  # made only once the warm-up is done


def test_the_warm_up_hashes_and_builds_the_driver_module_without_initialising_cuda(monkeypatch):
    done = []

    def initialises_cuda():
        raise AssertionError("torch.cuda.is_available() initialises CUDA (cuInit)")

    monkeypatch.setattr(launch.torch.cuda, "is_available", initialises_cuda)
    monkeypatch.setattr(launch.torch.cuda, "device_count", lambda: 1)  # NVML's count
    monkeypatch.setattr(launch, "_hash_installation", lambda: done.append("hash"))
    monkeypatch.setattr(launch.triton.backends, "backends", {"nvidia": SimpleNamespace(driver=lambda: done.append("driver"))})
    launch._warm_up()
    assert done == ["hash", "driver"]
    monkeypatch.setattr(launch.torch.cuda, "device_count", lambda: 0)  # no GPU: nothing to prepare
    done.clear()
    launch._warm_up()
    assert done == []


def test_held_tensors_live_until_the_side_by_side_block_ends():
    """Inside ``kernels_side_by_side`` a launch's global scratch and the tensors given to ``hold``
    outlive their callers' references until the block ends: kernels of the block may still run
    beside the next one. Outside a block ``hold`` keeps nothing."""
    allocate = launch._scratch_allocator(torch.device("cpu"))
    with launch.kernels_side_by_side():
        scratch, tensor = allocate(64, 16, None), torch.ones(4)
        refs = [weakref.ref(scratch), weakref.ref(tensor)]
        launch.hold(tensor)
        del scratch, tensor
        gc.collect()
        assert all(ref() is not None for ref in refs)
    gc.collect()
    assert all(ref() is None for ref in refs)
    outside = torch.ones(4)
    ref = weakref.ref(outside)
    launch.hold(outside)
    del outside
    gc.collect()
    assert ref() is None
