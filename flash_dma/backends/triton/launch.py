"""Launching autotuned kernels with little host overhead.

``triton.autotune`` re-derives its key from every argument on every call, which costs more
host time than a small attention kernel runs. ``TunedKernel`` lets the autotuner choose once
per tuning key (results also cached on disk by Triton), remembers the choice, and afterwards
launches the plain kernel with positional arguments.
"""

from __future__ import annotations

import inspect

import triton

from flash_dma.backends.triton.configs import autotune_enabled

# The autotuner only tunes when given more than one config; the real candidates come from `prune`.
_PLACEHOLDER_CONFIGS = [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}), triton.Config({"BLOCK_M": 32, "BLOCK_N": 32})]


class TunedKernel:
    """A jit kernel whose last two parameters, BLOCK_M and BLOCK_N, come from a tuned config.

    Args:
        kernel: the ``@triton.jit`` function.
        key: argument names the choice depends on (besides the tensors' dtypes and device).
        prune: ``prune(configs, args) -> [Config]``: the candidates for these arguments, best
            guess first (the only one tried when tuning is off).
        reset_to_zero: tensor arguments the kernel accumulates into, cleared between trials.
    """

    def __init__(self, kernel, key: list[str], prune, reset_to_zero: list[str] | None = None):
        self.kernel = kernel
        self.key = key
        self.prune = prune
        self.tuner = triton.autotune(
            configs=_PLACEHOLDER_CONFIGS,
            key=key,
            prune_configs_by={"early_config_prune": prune},
            reset_to_zero=reset_to_zero,
            cache_results=True,
        )(kernel)
        self.chosen: dict[tuple, triton.Config] = {}
        self.arg_names = kernel.arg_names[:-2]
        assert kernel.arg_names[-2:] == ["BLOCK_M", "BLOCK_N"], kernel.arg_names[-2:]
        # Pointer arguments: their dtypes are part of the tuning key, as for triton.autotune.
        parameters = inspect.signature(kernel.fn).parameters.values()
        self.pointer_names = [p.name for p in parameters if "constexpr" not in str(p.annotation) and p.name[0].isupper()]

    def __call__(self, grid, args: dict) -> None:
        if not autotune_enabled():
            config = self.prune([], args)[0]
        else:
            pointers = [args[name] for name in self.pointer_names]
            key = (pointers[0].device, *(args[name] for name in self.key), *(getattr(t, "dtype", None) for t in pointers))
            config = self.chosen.get(key)
            if config is None:
                self.tuner[grid](**args)
                self.chosen[key] = self.tuner.best_config
                return
        self.kernel[grid](*(args[name] for name in self.arg_names), **config.all_kwargs())
