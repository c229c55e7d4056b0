"""v1's ``utils`` package: :mod:`flash_dma.v1.utils.mask`."""
