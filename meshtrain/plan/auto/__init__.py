"""``strategy="auto"``: the search over degrees, ZeRO stage and checkpointing (``search``) and over
expert layouts (``experts``) — pure.

The names of the module this package replaced still resolve here, with a
``DeprecationWarning`` (:func:`meshtrain.moved.moved_names`).
"""

from meshtrain.moved import moved_names

__getattr__ = moved_names(__name__)
