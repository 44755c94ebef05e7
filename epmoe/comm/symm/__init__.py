"""Backends on torch symmetric memory (one NVLink node): our own Triton kernels store
straight into peers' buffers and synchronise with release/acquire flags.

``ll.py``: ``symm_ll``, the low-latency ExpertBatched backend (fixed buffers, graph safe,
FP8 dispatch); ``ht.py``: ``symm_ht``, its Standard-layout sibling for prefill (rows read
in place, SM budget); ``common.py``: their shared buffers, checks and launcher;
``kernels.py``: the Triton kernels of both.
"""
