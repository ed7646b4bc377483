"""Tensor and sequence parallelism, lowered: module styles onto ``parallelize_module``
(``parallel``), the parameters a plan leaves whole on the tensor-parallel mesh (``replicated``),
outputs updated in place handed out fresh (``fresh_outputs``).
"""
