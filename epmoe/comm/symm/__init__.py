"""Backends on torch symmetric memory (one NVLink node): our own Triton kernels store
straight into peers' buffers and synchronise with release/acquire flags.

``ll.py``: ``symm_ll``, the low-latency ExpertBatched backend (fixed buffers, graph safe,
FP8 dispatch); ``kernels.py``: its Triton kernels.
"""
