"""Materialise a model built on the meta device after ``mt.apply``: each rank allocates only its
own shards and fills them with the values a CPU build from the same seed would hold.

The values come from each module's own initialiser, run on full-size CPU tensors for that module's
direct parameters and buffers only, then cut to the rank's shard without a collective (so a
rank's peak memory at start-up is its shards at rest plus the largest single module):

- meshtrain's :class:`~meshtrain.models.llama.Llama`: its ``init_weights(generator)``;
- a ``transformers`` model: its ``_init_weights(module)`` (what ``post_init`` runs), module by
  module, children before parents, as ``initialize_weights`` does;
- any other module: its ``reset_parameters()`` (``nn.Linear``, ``nn.Conv2d``, ``nn.BatchNorm2d``,
  ``nn.Embedding``, ``nn.LayerNorm``, ...).

Each module draws from a generator seeded with (seed, FQN), so the values do not depend on the mesh
or on which pipeline stage holds the module, and :func:`initialise` on a CPU model built the
ordinary way gives the same tensors. A parameter or buffer that no initialiser sets (a custom
``nn.Parameter`` filled in ``__init__``, a table computed at construction) is refused by name:
uninitialised memory is never trained.

Example (on every rank, after ``mt.init_distributed()``)::

    with torch.device("meta"):
        model = MyModel()
    model = mt.apply(mt.plan(model, mesh, rules), model)
    mt.materialise(model, device="cpu", seed=0)
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from meshtrain.adapters.nf4 import is_nf4, scale_mean, scale_sums, write_nf4
from meshtrain.errors import PlanError
from meshtrain.lower.pipeline import PipelinedModel
from meshtrain.lower.tensor.parallel import PartialGradSync

Initialiser = Callable[[nn.Module], None]


def materialise(model: Any, *, device: str | torch.device = "cpu", seed: int = 0) -> Any:
    """Allocate ``model``'s local shards on ``device`` and initialise them from ``seed``.

    ``model`` is what ``mt.apply`` returned for a model built on the meta device (a module, or a
    pipelined model whose stage modules are materialised one by one), or a plain meta module.
    Returns ``model``.

    Example:
        >>> with torch.device("meta"):
        ...     layer = nn.Linear(4, 2)
        >>> materialise(layer, seed=0).weight.is_meta
        False
    """
    stages = model.modules if isinstance(model, PipelinedModel) else [model]
    for module in stages:
        shared = _shared_parameters(module)
        module.to_empty(device=device)  # ties are lost, and gradient hooks no longer fire
        if not any(isinstance(sub, FSDPModule) for sub in module.modules()):
            _fresh_parameters(module)  # FSDP2 re-registers its own; the rest need new ones
        for owners in shared:
            first, name = owners[0]
            for owner, other in owners[1:]:
                owner._parameters[other] = first._parameters[name]
        sync = getattr(module, "_meshtrain_partial_grads", None)
        if isinstance(sync, PartialGradSync):
            sync.attach(module)  # the gradient hooks lowering put on the meta parameters
        initialise(module, seed=seed)
    return model


def _fresh_parameters(model: nn.Module) -> None:
    """Each parameter as a new ``nn.Parameter`` over its (already allocated) data: after
    ``to_empty`` a DTensor parameter's gradient no longer reaches hooks registered on it."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = nn.Parameter(
                    param.detach(), requires_grad=param.requires_grad
                )


def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(module, name) owners of each parameter held by more than one attribute (tied weights)."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, name))
    return [group for group in owners.values() if len(group) > 1]


def initialise(model: nn.Module, *, seed: int = 0) -> nn.Module:
    """(Re)initialise every parameter and buffer of ``model`` in place from ``seed``, as
    :func:`materialise` does (plain tensors or DTensor shards alike). Returns ``model``.

    Example:
        >>> a, b = nn.Linear(4, 2), nn.Linear(4, 2)
        >>> torch.equal(initialise(a).weight, initialise(b).weight)
        True
    """
    init_weights = getattr(model, "init_weights", None)
    if callable(init_weights) and "generator" in inspect.signature(init_weights).parameters:
        adapters = _adapters(model)
        quantized = _nf4_weights(model)
        # meshtrain's own models initialise their own parameters; an NF4 weight one at a time
        with _hidden(adapters, _ADAPTER_NAMES), _hidden(quantized, ("weight",)):
            init_weights(generator=torch.Generator().manual_seed(seed))
        for fqn, module in quantized:
            with torch.no_grad():
                _initialise_alone(model, fqn, module, init_weights, seed)
        for fqn, module in adapters:
            with torch.no_grad():
                _initialise_module(fqn, module, _reset_adapter, seed, names=_ADAPTER_NAMES)
        return model
    initialiser = _initialiser(model)
    for fqn, module in _children_first(model):
        with torch.no_grad():
            _initialise_module(fqn, module, initialiser, seed)
    return model


#: A LoRA Linear's own parameters (``reset_lora_parameters`` sets them).
_ADAPTER_NAMES = ("lora_A", "lora_B")


def _adapters(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (fqn, module)
        for fqn, module in model.named_modules()
        if callable(getattr(module, "reset_lora_parameters", None))
    ]


def _reset_adapter(module: nn.Module) -> None:
    module.reset_lora_parameters()  # type: ignore[operator]


def _nf4_weights(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules whose ``weight`` is stored as NF4 (QLoRA's base)."""
    found = []
    for fqn, module in model.named_modules():
        weight = module._parameters.get("weight")
        if weight is not None and is_nf4(held(weight)):
            found.append((fqn, module))
    return found


def _initialise_alone(
    model: nn.Module, fqn: str, module: nn.Module, init_weights: Callable[..., None], seed: int
) -> None:
    """Run the model's ``init_weights`` with only ``module.weight`` in sight, held by a full-size
    fp32 CPU stand-in (one weight's memory), then write this rank's NF4 shard of it."""
    weight = module._parameters["weight"]
    assert weight is not None
    stand_in = {"weight": _sentinel(weight, torch.float32)}
    others = [(name, sub) for name, sub in model.named_modules() if sub is not module]
    rest = tuple(name for name in module._parameters if name != "weight")
    with _hidden(others, None), _hidden([(fqn, module)], rest), _swapped(module, stand_in):
        init_weights(generator=torch.Generator().manual_seed(seed))
    full = stand_in["weight"]
    if _unset(full):
        raise PlanError(
            f"materialise: the model's init_weights does not set '{fqn}.weight' (an NF4 base "
            "weight). Give it an initialiser, or load the weights with init_from."
        )
    _copy_shard(weight, full)


@contextlib.contextmanager
def _hidden(modules: list[tuple[str, nn.Module]], names: tuple[str, ...] | None) -> Iterator[None]:
    """The ``names`` parameters (all, with ``None``) of ``modules`` out of sight (a model's own
    initialiser does not know adapters; an NF4 weight is initialised on its own)."""
    saved = [
        (module, name, module._parameters.pop(name))
        for _, module in modules
        for name in list(module._parameters)
        if names is None or name in names
    ]
    try:
        yield
    finally:
        for module, name, param in saved:
            module._parameters[name] = param


def _initialiser(model: nn.Module) -> Initialiser:
    """The model family's per-module initialiser (see the module doc)."""
    hf_init = getattr(model, "_init_weights", None)

    def reset(module: nn.Module) -> None:
        reset_parameters = getattr(module, "reset_parameters", None)
        if callable(reset_parameters):
            reset_parameters()

    if not callable(hf_init) or not hasattr(model, "config"):
        return reset

    def hf_then_adapters(module: nn.Module) -> None:
        hf_init(module)  # a LoRA Linear is an nn.Linear to it; its adapters are reset here
        if callable(getattr(module, "reset_lora_parameters", None)):
            _reset_adapter(module)

    return hf_then_adapters


def _children_first(model: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in model.named_children():
        yield from _children_first(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, model


def _initialise_module(
    fqn: str,
    module: nn.Module,
    initialiser: Initialiser,
    seed: int,
    names: tuple[str, ...] | None = None,
) -> None:
    """Run ``initialiser`` on full-size CPU stand-ins for ``module``'s direct tensors (those in
    ``names`` only, when given), then copy each into the real (possibly sharded) tensor; refuse
    a tensor the initialiser left unset."""
    targets = _direct_tensors(module)
    if names is not None:
        targets = {name: tensor for name, tensor in targets.items() if name in names}
    if not targets:
        return
    stand_ins = {name: _sentinel(tensor) for name, tensor in targets.items()}
    with _swapped(module, stand_ins), _seeded(seed, fqn):
        initialiser(module)
    for name, tensor in targets.items():
        full = stand_ins[name]
        if _unset(full):
            where = f"{fqn}.{name}" if fqn else name
            raise PlanError(
                f"materialise: '{where}' ({type(module).__name__}) is not set by the module's "
                "initialiser, so on the meta device it would train from uninitialised memory. "
                f"Give {type(module).__name__} a reset_parameters() that sets it, or build the "
                "model with full tensors on every rank (then mt.apply)."
            )
        _copy_shard(tensor, full)


def _direct_tensors(module: nn.Module) -> dict[str, Tensor]:
    tensors: dict[str, Tensor] = {
        name: param for name, param in module._parameters.items() if param is not None
    }
    tensors.update({name: buf for name, buf in module._buffers.items() if buf is not None})
    return tensors


def _sentinel(tensor: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """A full-size CPU tensor holding a value no initialiser writes by accident (an NF4 weight's
    in fp32, the dtype its values are drawn in before they are rounded and quantized)."""
    nf4 = is_nf4(held(tensor))
    dtype = dtype or (torch.float32 if nf4 else tensor.dtype)
    full = torch.empty(tensor.shape, dtype=dtype, device="cpu")
    if full.is_floating_point() or full.is_complex():
        return full.fill_(float("nan"))
    if full.dtype == torch.bool:
        return full.fill_(False)  # nothing can be detected; masks are recomputed or loaded
    return full.fill_(torch.iinfo(full.dtype).min)


def _unset(full: Tensor) -> bool:
    if full.numel() == 0 or full.dtype == torch.bool:
        return False
    if full.is_floating_point() or full.is_complex():
        return bool(torch.isnan(full).any())
    return bool((full == torch.iinfo(full.dtype).min).any())


@contextlib.contextmanager
def _swapped(module: nn.Module, stand_ins: dict[str, Tensor]) -> Iterator[None]:
    saved_params = dict(module._parameters)
    saved_buffers = dict(module._buffers)
    for name, full in stand_ins.items():
        if name in saved_params:
            param = saved_params[name]
            requires_grad = bool(param is not None and param.requires_grad)
            module._parameters[name] = nn.Parameter(full, requires_grad=requires_grad)
        else:
            module._buffers[name] = full
    try:
        yield
    finally:
        for name in stand_ins:
            if name in saved_params:
                rebound = module._parameters[name]  # an initialiser may rebind it
                stand_ins[name] = rebound.data if rebound is not None else stand_ins[name]
                module._parameters[name] = saved_params[name]
            else:
                stand_ins[name] = module._buffers[name]  # type: ignore[assignment]
                module._buffers[name] = saved_buffers[name]


@contextlib.contextmanager
def _seeded(seed: int, fqn: str) -> Iterator[None]:
    """Torch's default CPU generator seeded from (seed, FQN), restored afterwards."""
    digest = hashlib.sha256(f"{seed}:{fqn}".encode()).digest()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int.from_bytes(digest[:8], "little") % (2**63))
        yield


def held(tensor: Tensor) -> Tensor:
    """The tensor this rank holds: a DTensor's local tensor object itself (``to_local()`` returns a
    view, and an NF4 weight's storage must be written into the object FSDP2 keeps), else
    ``tensor``."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _copy_shard(tensor: Tensor, full: Tensor) -> None:
    """Copy ``full`` (CPU, global shape) into ``tensor``: this rank's shard of it for a DTensor
    (cut locally, no collective); an NF4 weight quantized around ``full``'s own scale mean, so
    every shard carries the whole weight's."""
    target = held(tensor)
    local = full
    if isinstance(tensor, DTensor):
        mesh = tensor.device_mesh
        local = distribute_tensor(
            full.to(mesh.device_type), mesh, tensor.placements, src_data_rank=None
        ).to_local()
    if is_nf4(target):
        rounded = full.to(target.dtype)
        write_nf4(target, local, scale_mean(scale_sums(rounded), target.dtype))
    else:
        target.data.copy_(local)
