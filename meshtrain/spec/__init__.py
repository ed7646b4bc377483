"""The spec layer: ``P``, mesh descriptions, rules and P ⇄ DTensor placements.

Pure description: nothing here starts a process, creates a process group or issues a collective
(:mod:`meshtrain.launch` starts processes; :mod:`meshtrain.lower` binds meshes to them).
"""

from typing import Any

from meshtrain.spec.layout import local_shape, shard_slices, validate_spec
from meshtrain.spec.logical import annotate, named_logical_axes
from meshtrain.spec.mesh import Mesh, make_mesh
from meshtrain.spec.partition import P
from meshtrain.spec.rules import ParamSpec, Resolution, Rules

_PLACEMENTS = ("from_placements", "to_placements")


def __getattr__(name: str) -> Any:
    """``from_placements`` and ``to_placements`` import DTensor (2 s on a small CPU): only when
    asked for, so a model or a recipe that never meets a DTensor does not pay for it."""
    if name in _PLACEMENTS:
        from meshtrain.spec import placements

        return getattr(placements, name)
    raise AttributeError(f"module 'meshtrain.spec' has no attribute {name!r}")


__all__ = [
    "Mesh",
    "P",
    "ParamSpec",
    "Resolution",
    "Rules",
    "annotate",
    "from_placements",
    "local_shape",
    "make_mesh",
    "named_logical_axes",
    "shard_slices",
    "to_placements",
    "validate_spec",
]
