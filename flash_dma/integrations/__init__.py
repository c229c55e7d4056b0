"""Integrations of flash-dma with other libraries; each needs its library installed (an extra)."""
