"""What a rank holds: activation memory traced on fake tensors (``activations``), the per-rank
report ``meshtrain plan`` prints (``footprint``), byte sizes as people write them (``sizes``)
— pure.
"""
