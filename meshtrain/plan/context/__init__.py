"""Context parallelism, planned: which axis splits each sequence and what it refuses (``axis``),
and its memory and traffic (``cost``) — pure.

The names of the module this package replaced still resolve here, with a
``DeprecationWarning`` (:func:`meshtrain.moved.moved_names`).
"""

from meshtrain.moved import moved_names

__getattr__ = moved_names(__name__)
