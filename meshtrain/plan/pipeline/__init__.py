"""Pipeline parallelism, planned: schedules and the stage → rank layout (``schedule``), the units
of each stage (``stages``), bubble and point-to-point cost (``cost``) — pure.

The names of the module this package replaced still resolve here, with a
``DeprecationWarning`` (:func:`meshtrain.moved.moved_names`).
"""

from meshtrain.moved import moved_names

__getattr__ = moved_names(__name__)
