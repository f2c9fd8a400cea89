"""Fractus CTE: multi-level causal linear attention, a Kuramoto phase clock and
phase-routed sparse low-rank experts, with Triton kernels for the hot ops."""

__version__ = "0.1.0"
