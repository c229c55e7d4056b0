"""``flash-dma demo``: a small causal transformer learns a long-context recall task, sparse vs dense.

- :mod:`~flash_dma.demo.task`: the synthetic key-value recall task.
- :mod:`~flash_dma.demo.model`: the transformer built from :class:`~flash_dma.modules.DynamicMaskAttention`.
- :mod:`~flash_dma.demo.train`: training, evaluation and the measured curves.
- :mod:`~flash_dma.demo.report`: the plot, the JSON summary and the pass/miss lines.
- :mod:`~flash_dma.demo.arguments`: the command line's arguments.
- :mod:`~flash_dma.demo.cli`: the run, and its CPU and CUDA configurations.
"""
