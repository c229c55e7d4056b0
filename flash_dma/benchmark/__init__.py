"""Benchmark of flash-dma against FlexAttention and SDPA: ``flash-dma bench`` (needs CUDA).

- :mod:`~flash_dma.benchmark.suites`: the cases (shapes, masks, which methods and passes).
- :mod:`~flash_dma.benchmark.inputs`: the shared tensors of a case and its mask.
- :mod:`~flash_dma.benchmark.methods`: the attention implementations, fed the same tensors.
- :mod:`~flash_dma.benchmark.llama`: the transformers Llama of the llama and firstcall suites.
- :mod:`~flash_dma.benchmark.measure`: warm-up, peak memory and timing of one row; host time per call.
- :mod:`~flash_dma.benchmark.clocks`: the SM clock while a row is timed, and why it was lowered (``nvidia-smi``).
- :mod:`~flash_dma.benchmark.first_call`: the first call in a new (child) process.
- :mod:`~flash_dma.benchmark.metrics`: active (q, k) pairs, FLOPs and K/V bytes.
- :mod:`~flash_dma.benchmark.runner`: runs every row, recording failures as skipped rows.
- :mod:`~flash_dma.benchmark.results`: the result rows, and selecting them.
- :mod:`~flash_dma.benchmark.targets`: the PASS/MISS checks against the project's targets.
- :mod:`~flash_dma.benchmark.report` and :mod:`~flash_dma.benchmark.plots`: results.json/.md/.png.
- :mod:`~flash_dma.benchmark.cli`: the command line.

Everything imports on a CPU-only machine; CUDA-only pieces are reached only when a row runs.
"""
