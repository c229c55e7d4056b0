"""Fuzz harness: random attention problems, Triton kernels against the float64 reference.

``configs.py`` draws a problem from (seed, trial index), ``check.py`` runs one and compares it,
``report.py`` summarises a run, ``run.py`` is the command line. ``test_fuzz.py`` runs a short
version on the CPU.
"""
