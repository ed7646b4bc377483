"""Expert parallelism, lowered: experts split over the expert axis with a dropless dispatch
(``parallel``), tensor parallelism inside experts (``tensor``), balance counts over the whole
batch (``balance``).
"""
