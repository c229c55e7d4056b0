"""The warp-specialised Gluon kernels for Hopper (sm90): ``common.py`` (shared machinery), ``forward.py``, ``dq.py``, ``dkdv.py``; and ``transpose.py``, the FP8 forward's copy of V."""
