"""Launching jit kernels with little host time, and choosing their tile configuration.

A call through ``kernel[grid](...)`` binds and specialises every argument on every call, which
costs more host time than a small attention kernel runs. :class:`Launcher` does that work once
per *launch signature* (the configuration plus everything Triton specialises on: dtypes, pointer
alignment, and the value classes of the specialised ints) and afterwards calls the compiled
kernel's launcher directly with the positional arguments.

The configuration of a problem kind (the caller's ``key``) is chosen once per process:

- a choice stored on disk by an earlier tuning run on this machine, if any (see
  :func:`tuning_cache_path`: keyed by GPU name, Triton version and kernel source);
- else, with ``FLASH_DMA_AUTOTUNE=1``, the fastest candidate, timed on the call's own
  arguments, then stored on disk, so that tuning runs once per machine, not once per process;
- else the first candidate, from the shipped table of ``configs.py`` (best first).

Whichever way, a candidate whose shared memory exceeds the device's is passed over.
Under the Triton interpreter the first candidate runs through ``kernel[grid]``.

Compiling ahead. On an empty cache each kernel takes seconds to compile (Triton's passes, ptxas,
and the host compiler for its C launcher), and a call's launches would compile theirs one after
another, the backward's only once the forward is done. Instead, a backend entry point names the
call's *dry run* in :data:`AHEAD` for the length of the call: its host code (forward and backward),
run once more under :func:`dry_run`, where a launch launches nothing and starts compiling its
kernel on a pool of threads (:meth:`Launcher.compile_ahead`). The call's first launch that needs a
kernel compiled runs it (:func:`run_ahead`); then every kernel of the call compiles side by side,
and each launch waits for its own. Threads suffice for all but Triton's front end (Python, holding
the GIL: docs/design-notes.md, "The first call: the kernels it compiles"): Triton releases the GIL
in its LLVM passes and runs ptxas and the host compiler as subprocesses. The compilations therefore
take turns until their front ends end (:class:`_FrontEnds`), the Gluon kernels' first; each kernel's C launcher
builds as soon as its front end is done (:func:`_build_launcher`), and the interpreter's switch
interval is short while the pool works (:class:`_QuickHandOffs`), so that a back end taking the
GIL back does not wait 5 ms each time for a front end. Never under CUDA
graph capture (the dry run allocates), ``torch.compile`` tracing (the entry point sets nothing),
autotuning or the interpreter (``configs.compile_ahead_enabled``), nor with
``FLASH_DMA_COMPILE_AHEAD=0``.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import inspect
import json
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.backends
import triton.runtime.cache
import triton.testing
from triton.runtime import _allocation

from flash_dma.backends.triton.configs import autotune_enabled, compile_ahead_enabled, triton_interpreting
from flash_dma.backends.triton.kernel_keys import cache_key
from flash_dma.memo import DRY_RUN, Memo, forget_memos

_I32 = 2**31


def tuning_cache_path(kernel) -> Path:
    """The file that holds tuning choices for ``kernel`` on the current GPU and Triton version."""
    root = Path(os.environ.get("FLASH_DMA_CACHE_DIR", Path.home() / ".cache" / "flash_dma"))
    identity = f"{torch.cuda.get_device_name()}|{triton.__version__}|{cache_key(kernel)}"
    return root / f"tuning-{kernel.__name__}-{hashlib.sha256(identity.encode()).hexdigest()[:20]}.json"


def _driver():
    """Triton's driver (made on first use), once the warm-up (:func:`_warm_up`), if it runs, has
    built the driver's C module: made side by side, both would compile it."""
    if _WARM_UP is not None:
        _WARM_UP.join()
    return triton.runtime.driver.active


@functools.cache
def _stream_of():
    """Triton's current-stream getter (the driver exists only once CUDA is up)."""
    return _driver().get_current_stream


def _grid3(grid: tuple) -> tuple:
    return (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)


def _int_spec(value: int):
    """What Triton specialises an int argument on: 1 is a constant; else its width and divisibility by 16."""
    return 1 if value == 1 else (-_I32 <= value < _I32, value % 16 == 0)


_LAUNCHERS: list["Launcher"] = []


def _constexpr_slots(kernel) -> list[int]:
    """Positions of the kernel's constexpr parameters (read off its signature under the
    interpreter, whose jit functions do not list them)."""
    slots = getattr(kernel, "constexprs", None)
    if slots is None:
        parameters = inspect.signature(kernel.fn).parameters.values()
        slots = [i for i, parameter in enumerate(parameters) if "constexpr" in str(parameter.annotation)]
    return list(slots)


def _not_specialized_slots(kernel) -> list[int]:
    """Positions of the kernel's ``do_not_specialize`` parameters (named or numbered). A compiled
    jit function keeps the list as an attribute (empty when none); the interpreter's keeps the
    decorator's arguments instead (None when none)."""
    if hasattr(kernel, "do_not_specialize"):
        listed = kernel.do_not_specialize
    else:
        listed = kernel.kwargs.get("do_not_specialize")
    return [p if isinstance(p, int) else kernel.arg_names.index(p) for p in listed or ()]


def forget_choices() -> None:
    """Drop every launcher's chosen configurations and compiled handles, and every memoised
    decision, so that the next calls choose again (for example after ``FLASH_DMA_AUTOTUNE`` or
    ``FLASH_DMA_CACHE_DIR`` changed)."""
    for launcher in _LAUNCHERS:
        launcher.choices.clear()
        launcher.compiled.clear()
        launcher.pending.clear()
        launcher._stored = None
    forget_memos()


_HELD: ContextVar[list | None] = ContextVar("flash_dma_held", default=None)


@contextmanager
def kernels_side_by_side() -> Iterator[None]:
    """A block whose kernels may run side by side: one launched with ``launch_pdl`` starts beside
    the kernel before it (``hopper.common.let_next_kernel_start``). PyTorch's caching allocator
    hands memory on in stream order, as if each kernel ended before the next began; so the
    memory the block's kernels use (each launch's global scratch, the tensors given to
    :func:`hold`) is kept until the block ends, and each kernel that starts early waits for the
    one before it before it ends (``hopper.common.wait_for_previous_kernel``)."""
    token = _HELD.set([])
    try:
        yield
    finally:
        _HELD.reset(token)


def hold(*tensors) -> None:
    """Keep ``tensors`` until the :func:`kernels_side_by_side` block around this call ends (outside
    one, nothing to do: every kernel ends before the next begins)."""
    held = _HELD.get()
    if held is not None:
        held.extend(tensors)


@functools.lru_cache(maxsize=None)
def _scratch_allocator(device: torch.device):
    """Triton's allocator for a launch's global scratch on ``device`` (where kernels build TMA descriptors).

    A fresh buffer per launch, from PyTorch's caching allocator (which reuses it once the launch's
    stream is past it). A buffer kept across calls would, if first made inside a graph's memory
    pool (a capture, or torch.compile's cudagraph-tree warm-up), outlive the pool's own tensors:
    torch.compile's ``mode="reduce-overhead"`` refuses that.
    """

    def allocate(size: int, alignment: int, stream) -> torch.Tensor:
        buffer = torch.empty(size, dtype=torch.int8, device=device)
        hold(buffer)
        return buffer

    return allocate


class Prepared:
    """A compiled launch whose only changing arguments are its tensors."""

    __slots__ = ("kernel", "compiled", "grid", "template", "slots", "options", "scratch")

    def __init__(self, kernel, compiled, grid: tuple, args: list, slots: list, options: dict):
        # The template keeps no tensor: a memoised launch must not hold the memory of the call it came from.
        template = list(args)
        for slot in slots:
            template[slot] = None
        self.kernel, self.compiled, self.grid, self.template, self.slots, self.options = (
            kernel, compiled, grid, template, slots, options,
        )
        self.scratch = compiled is not None and getattr(compiled.metadata, "global_scratch_size", 0) > 0

    def run(self, tensors: list, addresses: list) -> None:
        """Launch with ``tensors`` (in the kernel's pointer order) at ``addresses`` (their data pointers)."""
        args = self.template.copy()
        if self.compiled is None:  # the interpreter runs on the tensors themselves
            for slot, tensor in zip(self.slots, tensors):
                args[slot] = tensor
            self.kernel[self.grid](*args, **self.options)
            return
        for slot, address in zip(self.slots, addresses):
            args[slot] = address
        g, compiled = self.grid, self.compiled
        device = tensors[0].device
        stream = _stream_of()(device.index)
        if self.scratch:
            # Triton keeps its allocator in a context variable (per thread: autograd runs the
            # backward on a thread of its own), so it is set for this launch only, then restored.
            previous = _allocation._allocator.get()
            triton.set_allocator(_scratch_allocator(device))
        enter = triton.knobs.runtime.launch_enter_hook
        # Hooks (profilers) get what Triton's own launch gives them; without any, none is called.
        if enter is None or not getattr(enter, "calls", True):
            metadata = enter = leave = None
        else:
            leave = triton.knobs.runtime.launch_exit_hook
            metadata = compiled.launch_metadata(g, stream, *args)
        try:
            compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, metadata, enter, leave, *args)
        finally:
            if self.scratch:
                triton.set_allocator(previous)


class Launcher:
    """One jit kernel whose trailing parameters are a tile configuration (``triton.Config.kwargs``).

    Args:
        kernel: the ``@triton.jit`` function.
        tensors: names of its pointer parameters.
        specialized: names of its int parameters that Triton specialises (divisibility by 16 lets
            it vectorise row accesses); every other int parameter must be in the kernel's
            ``do_not_specialize`` list, so that its value never changes the compiled kernel.
        reset_to_zero: pointer parameters the kernel accumulates into (zeroed by the caller), cleared
            before each timing run and after the last.
        options: compile options of every configuration (Triton's backend options, e.g.
            ``launch_pdl``), beside the configuration's own.
    """

    def __init__(
        self, kernel, tensors: Sequence[str], specialized: Sequence[str], reset_to_zero: Sequence[str] = (),
        options: dict | None = None,
    ):
        self.kernel = kernel
        self.options = options or {}
        names = kernel.arg_names
        self.tensor_slots = [names.index(n) for n in tensors]
        self.int_slots = [names.index(n) for n in specialized]
        self.other_int_slots = _not_specialized_slots(kernel)
        self.reset_slots = [names.index(n) for n in reset_to_zero]
        self.constexpr_slots = _constexpr_slots(kernel)
        self.choices: dict = {}  # problem key -> Config
        self.compiled: dict = {}  # launch signature -> (CompiledKernel, Config)
        self.pending: dict = {}  # launch signature -> Future of (CompiledKernel, Config), compiling ahead
        self.plans = Memo()  # (caller's layout, pointers aligned) -> Prepared
        self._stored: dict | None = None  # tuning choices on disk, read on first use
        # Compiling ahead: Gluon kernels take their turns first (_FrontEnds).
        self.compile_rank = 0 if getattr(kernel, "is_gluon", lambda: False)() else 1
        _LAUNCHERS.append(self)

    def launch(self, layout, tensors: list, build: Callable[[], tuple[list, tuple]], candidates, grid) -> None:
        """Launch with ``tensors`` (the kernel's pointers, in order) on arguments memoised per ``layout``.

        ``build()`` gives ``(args, key)``: all parameters before the configuration's, and what
        the configuration choice depends on. It runs once per ``layout``, which must therefore
        determine everything in ``args`` but the tensors' addresses. ``candidates()`` lists the
        configurations and ``grid(config.kwargs)`` gives the grid. In a dry run (:func:`dry_run`)
        it launches nothing: it starts compiling the kernel (:meth:`compile_ahead`).
        """
        launches = _DRY.get()
        if launches is not None:
            launches.append((self.kernel.__name__, self.compile_ahead(*build(), candidates)))
            return
        addresses = [t.data_ptr() for t in tensors]
        # Triton specialises each pointer on its own 16-byte alignment: a misaligned call needs the pattern.
        aligned = math.gcd(*addresses) % 16 == 0
        layout = (layout, True if aligned else tuple(a % 16 == 0 for a in addresses))
        prepared = self.plans.get(layout)
        if prepared is None:
            args, key = build()
            prepared = self.plans.remember(layout, self.prepare(grid, args, key, candidates))
        prepared.run(tensors, addresses)

    def prepare(self, grid, args: list, key: tuple, candidates: Callable[[], list]) -> Prepared:
        """The compiled kernel for ``args`` and its configuration, ready to relaunch."""
        if triton_interpreting():
            config = candidates()[0]
            return Prepared(self.kernel, None, _grid3(grid(config.kwargs)), list(args), self.tensor_slots, config.all_kwargs())
        signature = self._signature(args, key)
        entry = self.compiled.get(signature)
        if entry is None:
            entry = self.compiled[signature] = self._compiled_ahead(signature, grid, args, key, candidates)
        compiled, config = entry
        return Prepared(self.kernel, compiled, _grid3(grid(config.kwargs)), [*args, *config.kwargs.values()], self.tensor_slots, {})

    def _signature(self, args: list, key: tuple) -> tuple:
        """The launch signature of ``args``: what picks the compiled kernel (see the class doc)."""
        self._check_classified(args)
        tensors = [args[i] for i in self.tensor_slots]
        addresses = [t.data_ptr() for t in tensors]
        ints = [args[i] for i in self.int_slots]
        others = [args[i] for i in self.other_int_slots]
        lowest = min(min(ints, default=0), min(others, default=0))
        highest = max(max(ints, default=0), max(others, default=0))
        # Fast path: every specialised int a multiple of 16 (so none is 1), and every int within int32.
        if math.gcd(*ints) % 16 == 0 and -_I32 <= lowest and highest < _I32:
            int_key = True
        else:
            int_key = (tuple(map(_int_spec, ints)), tuple(-_I32 <= x < _I32 for x in others))
        # The constexprs given in ``args`` are compiled in: a kernel built for one set serves no other.
        constants = tuple([args[i] for i in self.constexpr_slots if i < len(args)])
        return (key, constants, int_key, tuple([t.dtype for t in tensors]), tuple(a % 16 == 0 for a in addresses))

    def _check_classified(self, args: list) -> None:
        # An int the launcher does not classify would be specialised by Triton behind its back.
        known = {*self.int_slots, *self.other_int_slots, *self.constexpr_slots}
        stray = [self.kernel.arg_names[i] for i, a in enumerate(args) if type(a) is int and i not in known]
        if stray:
            raise TypeError(f"{self.kernel.__name__}: int parameters {stray} are neither specialized nor do_not_specialize")

    # -- compiling ahead (module doc) -----------------------------------------------------------

    def compile_ahead(self, args: list, key: tuple, candidates: Callable[[], list]) -> Future | None:
        """Start compiling the kernel that :meth:`prepare` would give ``args``, on the pool, unless
        it is compiled or compiling already; :meth:`prepare` waits for it. Returns the compilation's
        future, or None where there is nothing to compile (compiled already, or under the
        interpreter) or the choice needs the call's own tensors (autotuning)."""
        if triton_interpreting() or autotune_enabled():
            return None
        signature = self._signature(args, key)
        if signature in self.compiled:
            return None
        future = self.pending.get(signature)
        if future is None:
            pointers = list(args)
            for slot in self.tensor_slots:
                pointers[slot] = _Pointer(args[slot])
            future = _FRONT_ENDS.submit(_pool().threads, self.compile_rank, self._compile_on_pool, pointers, key, candidates())
            self.pending[signature] = future
        return future

    def _compile_on_pool(self, args: list, key: tuple, configs: list):
        """``(compiled, config)`` as :meth:`_compile` gives them, for a thread of the pool, its front
        end in its turn (:class:`_FrontEnds`); the kernel's C launcher is built too
        (by the host compiler, into Triton's cache), so that its first launch only loads it. No CUDA
        call: a graph may be captured meanwhile."""
        with _QUICK_HAND_OFFS.held():
            _pool().installation_hashed.result()
            with torch.cuda.device(args[self.tensor_slots[0]].device):
                compiled, config = self._compile(None, args, key, lambda: configs)
        _driver().launcher_cls(compiled.src, compiled.metadata)
        return compiled, config

    def _compiled_ahead(self, signature: tuple, grid, args: list, key: tuple, candidates: Callable[[], list]):
        """``(compiled, config)`` for ``signature``: from the pool, where the call's dry run (run
        here if it has not run yet) started it; else compiled here."""
        if signature not in self.pending:
            run_ahead()
        future = self.pending.get(signature)
        if future is None:
            return self._compile(grid, args, key, candidates)
        try:
            return future.result()
        except Exception:
            # Compiled again here: a genuine error then reaches the caller from its own call.
            return self._compile(grid, args, key, candidates)
        finally:
            self.pending.pop(signature, None)

    # -- the slow path: once per launch signature ----------------------------------------------

    def _compile(self, grid, args: list, key: tuple, candidates: Callable[[], list]):
        cache_key(self.kernel)  # the same key in every process (kernel_keys.py)
        config = self.choices.get(key)
        if config is None:
            config = self.choices[key] = self._choose(grid, args, key, candidates())
        compiled = self._build(args, config)
        if not self._fits(compiled, args):
            # This specialisation (other strides or head dim) needs more shared memory than the
            # one the choice was made on: take the first candidate that fits it.
            config, compiled = self._first_fitting(args, candidates())
        return compiled, config

    def _build(self, args: list, config: triton.Config):
        front_ends_in_turn(self.kernel, _driver().get_current_device())
        compiled = self.kernel.warmup(*args, grid=(1,), **config.all_kwargs(), **self.options)
        built = getattr(compiled.src, "launcher_built", None)
        if built is not None:  # on the pool or in the call: its launcher is then loaded from the cache, not built twice side by side
            built.join()
        return compiled

    def _fits(self, compiled, args: list) -> bool:
        device = args[self.tensor_slots[0]].device.index
        return compiled.metadata.shared <= _driver().utils.get_device_properties(device)["max_shared_mem"]

    def _fitting(self, args: list, configs: list):
        """``(config, compiled)`` of each candidate that fits the device, in order, compiled lazily."""
        for config in configs:
            compiled = self._build(args, config)
            if self._fits(compiled, args):
                yield config, compiled

    def _first_fitting(self, args: list, configs: list):
        for found in self._fitting(args, configs):
            return found
        raise RuntimeError(
            f"{self.kernel.__name__}: none of the tile configurations {[c.all_kwargs() for c in configs]} "
            "fits the shared memory of this GPU"
        )

    def _choose(self, grid, args: list, key: tuple, configs: list) -> triton.Config:
        stored = self._read_stored().get(repr(key))
        if stored is not None:
            return triton.Config(stored["kwargs"], num_warps=stored["num_warps"], num_stages=stored["num_stages"])
        if not autotune_enabled() or len(configs) == 1:
            return self._first_fitting(args, configs)[0]
        timed = [(self._time(compiled, config, grid, args), config) for config, compiled in self._fitting(args, configs)]
        if not timed:
            self._first_fitting(args, configs)  # raises, naming the candidates
        best = min(timed, key=lambda pair: pair[0])[1]
        self._store(repr(key), best, {str(c.all_kwargs()): ms for ms, c in timed})
        return best

    def _time(self, compiled, config: triton.Config, grid, args: list) -> float:
        accumulators = [args[i] for i in self.reset_slots]

        tensors = [args[i] for i in self.tensor_slots]
        prepared = Prepared(self.kernel, compiled, _grid3(grid(config.kwargs)), [*args, *config.kwargs.values()], self.tensor_slots, {})
        addresses = [t.data_ptr() for t in tensors]

        def launch():
            for t in accumulators:
                t.zero_()
            prepared.run(tensors, addresses)

        ms = triton.testing.do_bench(launch, warmup=5, rep=25, return_mode="median")
        # The timed runs were on the call's own buffers: leave them as the caller made them.
        for t in accumulators:
            t.zero_()
        return ms

    def _read_stored(self) -> dict:
        if self._stored is None:
            path = tuning_cache_path(self.kernel)
            self._stored = json.loads(path.read_text()) if path.exists() else {}
        return self._stored

    def _store(self, key: str, config: triton.Config, timings: dict) -> None:
        # The timings (ms per candidate) are kept for whoever revises the shipped tables.
        self._stored[key] = {
            "kwargs": config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages, "timings_ms": timings,
        }
        path = tuning_cache_path(self.kernel)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(self._stored, indent=1, sort_keys=True))
        partial.replace(path)  # atomic: a concurrent process never reads half a file


# -- compiling ahead: the dry run and the pool (module doc) -----------------------------------

# For the length of a backend entry point's call, the call's dry run as ``(function, arguments)``:
# the call's first launch that needs a kernel compiled runs it (:func:`run_ahead`).
AHEAD: ContextVar[tuple | None] = ContextVar("flash_dma_ahead", default=None)
# While a dry run runs, the launches it reached, as ``(kernel name, compilation or None)``.
_DRY: ContextVar[list | None] = ContextVar("flash_dma_dry_launches", default=None)


class _Pointer:
    """What Triton's specialisation and the launcher read of a tensor argument (its dtype, its
    device and whether its address is 16-byte aligned), without the tensor: a compilation on the
    pool outlives the dry run, whose tensors are then freed for the call's own."""

    __slots__ = ("dtype", "device", "_address")

    def __init__(self, tensor: torch.Tensor):
        self.dtype, self.device, self._address = tensor.dtype, tensor.device, tensor.data_ptr() % 16

    def data_ptr(self) -> int:
        return self._address


class _Compilers(NamedTuple):
    """The threads that compile ahead, and Triton's hash of its own installation, computed once on them."""

    threads: ThreadPoolExecutor
    installation_hashed: Future


def _hash_installation() -> None:
    # Every Triton cache key starts with a hash of Triton's own files, libtriton's hundreds of MB
    # included (about 0.5 s), memoised per process but unguarded: compilations starting together
    # would each hash it, side by side. Where a Triton release keeps it elsewhere, they still do.
    key = getattr(triton.runtime.cache, "triton_key", None)
    if key is not None:
        key()


@functools.cache
def _pool() -> _Compilers:
    """One thread per CPU this process may run on. Triton's driver is made here, once the warm-up
    (which also hashed the installation) is done; the hash is taken again on the pool only where
    the warm-up did not (memoised, it then returns at once)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = ThreadPoolExecutor(max_workers=cpus, thread_name_prefix="flash-dma-compile")
    # Triton makes its driver on first use, unguarded: here, before any thread of the pool can.
    driver = _driver()
    hashed = threads.submit(_hash_installation)
    driver.get_current_target()
    return _Compilers(threads, hashed)


def _warm_up() -> None:
    """What a process's first compilation waits for, done as this module is imported, on a thread
    of its own: the hash of Triton's installation and the C module of Triton's CUDA driver (a host
    compile on an empty cache, then in Triton's cache), together 0.6-0.8 s of the cold first call
    (docs/design-notes.md, "The first call: the kernels it compiles"). It initialises no CUDA: GPUs
    are counted through NVML (``torch.cuda.device_count``; ``is_available`` would initialise the
    driver, fixing ``CUDA_VISIBLE_DEVICES`` and barring CUDA from forked children), and the driver
    object that Triton makes on first use, which asks ``is_available``, is not made here."""
    try:
        with _QUICK_HAND_OFFS.held():
            if torch.cuda.device_count() > 0:
                _hash_installation()
                cuda = triton.backends.backends.get("nvidia")
                if cuda is not None:
                    cuda.driver()  # builds the C module; the driver Triton makes later loads it from the cache
    except Exception:  # the first compilation does both again, and reports what fails
        pass


class _QuickHandOffs:
    """A short switch interval for the interpreter while this module's threads compile or warm up.

    Those threads spend their time in C calls that give the GIL up (Triton's passes, reading and
    hashing files, waiting for ptxas), and each must take it back. While another thread runs Python
    (a front end, the caller's imports), each taking back waits for that thread's switch interval,
    5 ms by default: hashing Triton's installation in 1 MB chunks took 6.2 s beside a busy thread
    instead of 0.4, and a forward kernel's compilation 12.8 s instead of 6.0 (CPU machine). With an
    interval of 0.1 ms they took 0.6 and 5.2 s. The interval is set when the first such task starts
    and set back when the last ends, unless someone else changed it meanwhile."""

    INTERVAL_S = 1e-4

    def __init__(self):
        self._lock = threading.Lock()
        self._running = 0
        self._previous = self._ours = sys.getswitchinterval()

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self._running == 0:
                self._previous = sys.getswitchinterval()
                sys.setswitchinterval(self.INTERVAL_S)
                self._ours = sys.getswitchinterval()  # as the interpreter keeps it: whole microseconds, not INTERVAL_S
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0 and sys.getswitchinterval() == self._ours:
                    sys.setswitchinterval(self._previous)


_QUICK_HAND_OFFS = _QuickHandOffs()


def _start_warm_up() -> threading.Thread | None:
    """The warm-up's thread, where kernels will be compiled (``compile_ahead_enabled``). A fork
    waits for it (``os.register_at_fork``): a process forked while a thread runs may deadlock."""
    if not compile_ahead_enabled():
        return None
    thread = threading.Thread(target=_warm_up, name="flash-dma-warm-up", daemon=True)
    thread.start()
    os.register_at_fork(before=thread.join)
    return thread


class _FrontEnds:
    """The pool's compilations, one at a time until each has passed its front end (a kernel's
    Python made into IR), the Gluon kernels' first.

    A front end holds the GIL, and so does the Python before it (the kernel's cache key, the tile
    choice, Triton's binder and cache lookup). Side by side, a call's compilations would share the
    GIL, and each would reach its LLVM passes and ptxas (which release it) as late as the last.
    So a compilation of the pool takes its turn as it starts and hands it on when its front end
    ends (or when it ends without one: a cached kernel). Turns go by ``(rank, ticket)``: rank 0
    for Gluon kernels, whose warp-specialised code compiles for several times longer than any
    other kernel's, so that the longest start first; then the order in which the call's launches
    handed their compilations over, which for the Gluon kernels is the order the call needs them
    (forward, dK/dV, dQ). docs/design-notes.md, "The first call: the kernels it compiles", has the
    timeline. A front end off the pool takes the next free turn.
    """

    FREE_TURN = ()  # a turn taken off the queue (a front end off the pool)

    def __init__(self):
        self._changed = threading.Condition()
        self._issued = 0
        self._queued: list[tuple[int, int]] = []  # (rank, ticket) of the started compilations' turns to come, in order
        self._running = False
        self._held = threading.local()  # the turn this thread holds: a queued place, FREE_TURN, or None

    def submit(self, threads: ThreadPoolExecutor, rank: int, compile_on_pool: Callable, *args) -> Future:
        """``threads.submit(compile_on_pool, *args)``, run in its turn: ``rank``, then a ticket taken
        here. Only a started compilation queues for a turn: one that no thread has started yet (the
        pool's threads all busy) holds none up."""
        with self._changed:
            place = (rank, self._issued)
            self._issued += 1
        return threads.submit(self._holding, place, compile_on_pool, *args)

    def _holding(self, place: tuple[int, int], compile_on_pool: Callable, *args):
        """``compile_on_pool(*args)`` in a thread of the pool, from the start of ``place``'s turn
        until its front end ends. The place is given up however the compilation ends (done, or
        failed): one left queued would hold every later turn up for good."""
        with self._changed:
            bisect.insort(self._queued, place)
            self._changed.wait_for(lambda: not self._running and self._queued[0] == place)
            self._running = True
        self._held.place = place
        try:
            return compile_on_pool(*args)
        finally:
            self._hand_on()  # no front end ran (a cached kernel, an error before it)

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Run a front end in this thread's turn, which ends with it; without one (off the pool, or
        a second front end of one compilation: another configuration), in the next free turn."""
        if getattr(self._held, "place", None) is None:
            with self._changed:
                self._changed.wait_for(lambda: not self._running)
                self._running = True
            self._held.place = self.FREE_TURN
        try:
            yield
        finally:
            self._hand_on()

    def _hand_on(self) -> None:
        """End the turn this thread holds, if any."""
        place, self._held.place = getattr(self._held, "place", None), None
        if place is not None:
            with self._changed:
                self._running = False
                if place in self._queued:
                    self._queued.remove(place)
                self._changed.notify_all()


_FRONT_ENDS = _FrontEnds()


class _FrontEndInTurn:
    """Mixed into a kernel's source class (Triton's ``ASTSource``, or Gluon's): its front end
    (``make_ir``) runs in its turn (:class:`_FrontEnds`), and then the kernel's C launcher starts
    building on a thread of its own (:func:`_build_launcher`) while Triton's passes and ptxas run. Neither the
    source's hash nor its cache key changes."""

    def make_ir(self, *args, **kwargs):
        with _FRONT_ENDS.turn():
            module = super().make_ir(*args, **kwargs)
        self.launcher_built = threading.Thread(target=_build_launcher, args=(self,), name="flash-dma-launcher", daemon=True)
        self.launcher_built.start()
        return module


class _NoDescriptors:
    # The compiled kernel's metadata as far as its C launcher's source reads it: the kernels make
    # their TMA descriptors on the device, so none is a parameter.
    tensordesc_meta = None


def _build_launcher(source) -> None:
    """Build ``source``'s C launcher into Triton's cache: its C source depends only on the kernel's
    signature and constants, known once the front end has run, so the host compiler (0.3-0.6 s a
    kernel) need not wait for the passes and ptxas. Triton's launcher class reads more of the
    metadata after building, which a source does not have yet: that error, or any other, is left to
    the launch, which builds (or loads) the launcher as it always does."""
    try:
        _driver().launcher_cls(source, _NoDescriptors())
    except Exception:
        pass


@functools.cache
def _in_turn(source: type) -> type:
    return type(f"{source.__name__}InTurn", (_FrontEndInTurn, source), {})


_SOURCES = threading.Lock()


def front_ends_in_turn(kernel, device: int) -> None:
    """Make ``kernel``'s compilations on ``device`` take their front ends in turn
    (:class:`_FrontEndInTurn`). A jit kernel makes its binder on a device's first use, which names
    its source class (``ASTSource``) anew: made first, here. The interpreter's kernel has neither."""
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        return
    with _SOURCES:
        caches[device]
        if not issubclass(kernel.ASTSource, _FrontEndInTurn):
            kernel.ASTSource = _in_turn(kernel.ASTSource)


def _after_fork_in_child() -> None:
    """A forked child has none of its parent's threads: it starts a pool of its own, and its front
    ends wait for no ticket of the parent's compilations, which will never run here."""
    global _FRONT_ENDS
    _pool.cache_clear()
    _FRONT_ENDS = _FrontEnds()


os.register_at_fork(after_in_child=_after_fork_in_child)


@contextmanager
def dry_run() -> Iterator[list[tuple[str, Future | None]]]:
    """Run the host code inside launching no kernel: each launch it reaches starts compiling its
    kernel on the pool (:meth:`Launcher.compile_ahead`). Yields the launches, as ``(kernel name,
    compilation)``: the compilation's future, or None where there was nothing to compile.

    What a dry run makes is never written: it is no result, and is not memoised
    (``flash_dma.memo.DRY_RUN``).
    """
    launches: list[tuple[str, Future | None]] = []
    token, dry = _DRY.set(launches), DRY_RUN.set(True)
    try:
        yield launches
    finally:
        DRY_RUN.reset(dry)
        _DRY.reset(token)


def run_ahead() -> None:
    """Run the current call's dry run (:data:`AHEAD`), once per call, where compiling ahead is on
    and no CUDA graph is being captured: every kernel of the call then compiles side by side."""
    ahead = AHEAD.get()
    if ahead is None:
        return
    AHEAD.set(None)
    if not compile_ahead_enabled() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return
    function, arguments = ahead
    try:
        with dry_run():
            function(*arguments)
    except Exception:
        # Compiling ahead only saves time: whatever stops the dry run (memory for its tensors beside
        # the call's, a backward the call never runs), the call goes on and compiles the rest itself.
        pass


_WARM_UP = _start_warm_up()
