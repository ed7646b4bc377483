"""Context parallelism, lowered: which tokens each rank holds (``layout``), models split along the
sequence (``parallel``), exact attention over blocks (``attention_blocks``) and around the ring
(``ring_attention``).
"""
