"""Tensor and sequence parallelism, planned: module styles (``styles``), column/row pairs
(``pairs``), where the sequence splits (``sequence``) and each style's cost (``cost``) — pure.
"""
