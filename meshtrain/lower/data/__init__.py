"""Data parallelism, lowered: FSDP2 or ``replicate`` per unit (``parallel``), BatchNorm over the
global batch (``batch_norm``), buffers averaged over the batch axes (``batch_buffers``).
"""
