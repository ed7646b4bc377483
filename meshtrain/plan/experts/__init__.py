"""Expert parallelism, planned: which axis splits the experts (``axis``), tensor parallelism inside
experts (``tensor``), their activations and cost (``activations``, ``cost``), and the router's
counts and logits (``router_counts``, ``router_logits``) — pure.

The names of the module this package replaced still resolve here, with a
``DeprecationWarning`` (:func:`meshtrain.moved.moved_names`).
"""

from meshtrain.moved import moved_names

__getattr__ = moved_names(__name__)
