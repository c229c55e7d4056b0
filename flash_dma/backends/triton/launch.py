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
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import triton
import triton.testing

from flash_dma.backends.triton.configs import autotune_enabled, triton_interpreting

_I32 = 2**31


def tuning_cache_path(kernel) -> Path:
    """The file that holds tuning choices for ``kernel`` on the current GPU and Triton version."""
    root = Path(os.environ.get("FLASH_DMA_CACHE_DIR", Path.home() / ".cache" / "flash_dma"))
    identity = f"{torch.cuda.get_device_name()}|{triton.__version__}|{kernel.cache_key}"
    return root / f"tuning-{kernel.__name__}-{hashlib.sha256(identity.encode()).hexdigest()[:20]}.json"


def _int_spec(value: int):
    """What Triton specialises an int argument on: 1 is a constant; else its width and divisibility by 16."""
    return 1 if value == 1 else (-_I32 <= value < _I32, value % 16 == 0)


_LAUNCHERS: list["Launcher"] = []


def forget_choices() -> None:
    """Drop every launcher's chosen configurations and compiled handles, so that the next calls
    choose again (for example after ``FLASH_DMA_AUTOTUNE`` or ``FLASH_DMA_CACHE_DIR`` changed)."""
    for launcher in _LAUNCHERS:
        launcher.choices.clear()
        launcher.compiled.clear()
        launcher._stored = None


class Launcher:
    """One jit kernel whose trailing parameters are a tile configuration (``triton.Config.kwargs``).

    Args:
        kernel: the ``@triton.jit`` function.
        tensors: names of its pointer parameters.
        specialized: names of its int parameters that Triton specialises (divisibility by 16 lets
            it vectorise row accesses); every other int parameter must be in the kernel's
            ``do_not_specialize`` list, so that its value never changes the compiled kernel.
        reset_to_zero: pointer parameters the kernel accumulates into, cleared before timing runs.
    """

    def __init__(self, kernel, tensors: Sequence[str], specialized: Sequence[str], reset_to_zero: Sequence[str] = ()):
        self.kernel = kernel
        names = kernel.arg_names
        self.tensor_slots = [names.index(n) for n in tensors]
        self.int_slots = [names.index(n) for n in specialized]
        not_specialized = getattr(kernel, "do_not_specialize", None) or kernel.kwargs["do_not_specialize"] or ()
        self.other_int_slots = [names.index(n) for n in not_specialized]
        self.reset_slots = [names.index(n) for n in reset_to_zero]
        self.choices: dict = {}  # problem key -> Config
        self.compiled: dict = {}  # launch signature -> (CompiledKernel, Config)
        self._stored: dict | None = None  # tuning choices on disk, read on first use
        _LAUNCHERS.append(self)

    def __call__(self, grid: Callable[[dict], tuple], args: list, key: tuple, candidates: Callable[[], list]) -> None:
        """Launch on ``grid(config.kwargs)``; ``args`` are all parameters before the config's."""
        if triton_interpreting():
            config = candidates()[0]
            self.kernel[grid(config.kwargs)](*args, **config.all_kwargs())
            return
        tensors = [args[i] for i in self.tensor_slots]
        ints = [args[i] for i in self.int_slots]
        others = [args[i] for i in self.other_int_slots]
        # Fast path: every specialised int a multiple of 16 (so none is 1), and every int within int32.
        lowest = min(min(ints, default=0), min(others, default=0))
        highest = max(max(ints, default=0), max(others, default=0))
        if math.gcd(*ints) % 16 == 0 and -_I32 <= lowest and highest < _I32:
            int_key = True
        else:
            int_key = (tuple(map(_int_spec, ints)), tuple(-_I32 <= x < _I32 for x in others))
        aligned = math.gcd(*(t.data_ptr() for t in tensors)) % 16 == 0
        signature = (
            key, int_key, tuple(t.dtype for t in tensors),
            True if aligned else tuple(t.data_ptr() % 16 == 0 for t in tensors),
        )
        entry = self.compiled.get(signature)
        if entry is None:
            entry = self.compiled[signature] = self._compile(grid, args, key, candidates)
        self._run(*entry, grid, args)

    def _run(self, compiled, config: triton.Config, grid: Callable[[dict], tuple], args: list) -> None:
        g = grid(config.kwargs)
        stream = triton.runtime.driver.active.get_current_stream(args[self.tensor_slots[0]].device.index)
        enter, leave = triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook
        metadata = compiled.launch_metadata(g, stream, *args) if enter is not None else None
        compiled.run(
            g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1, stream, compiled.function,
            compiled.packed_metadata, metadata, enter, leave, *args, *config.kwargs.values(),
        )

    # -- the slow path: once per launch signature ----------------------------------------------

    def _compile(self, grid, args: list, key: tuple, candidates: Callable[[], list]):
        config = self.choices.get(key)
        if config is None:
            config = self.choices[key] = self._choose(grid, args, key, candidates())
        return self._build(args, config), config

    def _build(self, args: list, config: triton.Config):
        return self.kernel.warmup(*args, grid=(1,), **config.all_kwargs())

    def _fits(self, compiled, args: list) -> bool:
        device = args[self.tensor_slots[0]].device.index
        return compiled.metadata.shared <= triton.runtime.driver.active.utils.get_device_properties(device)["max_shared_mem"]

    def _choose(self, grid, args: list, key: tuple, configs: list) -> triton.Config:
        stored = self._read_stored().get(repr(key))
        if stored is not None:
            return triton.Config(stored["kwargs"], num_warps=stored["num_warps"], num_stages=stored["num_stages"])
        tuning = autotune_enabled()
        timed = []
        for config in configs:
            compiled = self._build(args, config)
            if not self._fits(compiled, args):
                continue
            if not tuning:
                return config
            timed.append((self._time(compiled, config, grid, args), config))
        if not timed:
            raise RuntimeError(
                f"{self.kernel.__name__}: none of the tile configurations {[c.all_kwargs() for c in configs]} "
                "fits the shared memory of this GPU"
            )
        best = min(timed, key=lambda pair: pair[0])[1]
        self._store(repr(key), best)
        return best

    def _time(self, compiled, config: triton.Config, grid, args: list) -> float:
        accumulators = [args[i] for i in self.reset_slots]

        def launch():
            for t in accumulators:
                t.zero_()
            self._run(compiled, config, grid, args)

        return triton.testing.do_bench(launch, warmup=5, rep=25, return_mode="median")

    def _read_stored(self) -> dict:
        if self._stored is None:
            path = tuning_cache_path(self.kernel)
            self._stored = json.loads(path.read_text()) if path.exists() else {}
        return self._stored

    def _store(self, key: str, config: triton.Config) -> None:
        self._stored[key] = {"kwargs": config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}
        path = tuning_cache_path(self.kernel)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(self._stored, indent=1, sort_keys=True))
        partial.replace(path)  # atomic: a concurrent process never reads half a file
