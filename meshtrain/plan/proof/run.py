"""The plan-time abstract run: proves, before any collective, that each module computes on a
rank the shard of the activation one device computes; finds every replicated parameter whose
gradient is a partial sum over the tensor-parallel axis; and finds what would make an accepted
plan crash at its first forward or train differently from one device.

The model runs once on fake tensors (no memory, no process group) as a rank of the plan: its
parameters at their tensor-parallel local shapes, the probe inputs of :mod:`meshtrain.plan.proof.probe`
(``example_inputs``, or a batch meshtrain can build), and the styles' boundaries emulated in
module hooks (:mod:`~meshtrain.plan.proof.boundaries`: a column-wise output stays local, a
row-wise output is reduced, sequence-parallel regions gather and scatter). Every aten op on a
sharded tensor runs twice, on the rank's tensors and on one device's (kept beside each sharded
tensor; sizes the code read off a shard become one device's, :mod:`~meshtrain.plan.proof.sizes`),
and (:mod:`~meshtrain.plan.proof.prover`):

- the rank's output must be a shard of one device's along one dim (else a shape error: a sharded
  tensor mixed with a whole one, T5's position bias);
- a reshape must put the shard where a contiguous shard of its input lands (else the module
  reshapes with a global size: OPT's ``view(bsz, -1, num_heads, head_dim)`` on half the heads,
  while torchtitan's ``x.reshape(*x.shape[:-1], -1, 2)`` keeps the heads where they are);
- an op whose output is no longer sharded selects or reduces along the sharded dim (the CLS token
  of a sequence-sharded activation);

each refused with a :class:`~meshtrain.PlanError` naming the module, the op and a fix that plans
(:mod:`~meshtrain.plan.proof.refusals`). A trainable parameter replicated over the axis that
meets a sharded activation has a partial gradient: returned as a
:class:`~meshtrain.plan.ir.PartialGrad` (the lowering all-reduces it) when its module takes the
sharded activation as its first input, and refused otherwise. Beside the shards the run records
(:mod:`~meshtrain.plan.proof.effects`) parameters read outside their module, in-place updates
of styled outputs, buffers written from the batch and attention shapes under context
parallelism. Ops inside a styled module (its lowering owns them) are not looked at. Repeated
blocks of one signature run once (the others pass their input through when the first keeps its
shape and its shard), so planning a 126-layer model costs about what planning two does.

The run happens when a plan has a tensor-parallel axis larger than 1 and some style, a context
axis, data parallelism on a model with buffers a forward could write, or FSDP units resharded
after forward (ZeRO-3: an in-place update of such a unit's output drops FSDP2's pre-backward
hook, whose all-gather backward needs).

Example:
    >>> import meshtrain as mt
    >>> from meshtrain.models import LlamaConfig, build_llama, default_rules
    >>> model = build_llama(LlamaConfig.debug(), device="meta")
    >>> mesh = mt.make_mesh(dp=2, tp=2, world_size=4, abstract=True)
    >>> mt.plan(model, mesh, default_rules()).partial_grads
    ()
"""

from __future__ import annotations

import contextlib
import copy
import logging
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from meshtrain.errors import PlanError
from meshtrain.plan.ir import ModuleStyle, ParamLayout, ParamReader, PartialGrad
from meshtrain.plan.proof.boundaries import LEAF_STYLES, REGION_STYLES, Refused
from meshtrain.plan.proof.effects import Effects, buffer_owners, parameter_owners
from meshtrain.plan.proof.modules import LookalikeRan
from meshtrain.plan.proof.probe import Probe, current_example, probe_batch, probe_for, probe_length
from meshtrain.plan.proof.probe import signature as probe_signature
from meshtrain.plan.proof.prover import Prover
from meshtrain.plan.proof.refusals import no_probe, sharded_read, unproven
from meshtrain.spec.partition import entry_axes

__all__ = [
    "LEAF_STYLES",
    "REGION_STYLES",
    "Proof",
    "kept_as_notes",
    "probe_batch",
    "probe_length",
    "prove_plan",
    "refusals_as_notes",
]


@dataclass(frozen=True)
class Proof:
    """What the abstract run found (see module doc): partial gradients the lowering reduces,
    replicated parameters read outside their module (``readers``), styled modules whose output
    the forward updates in place (``fresh_outputs``), buffers written from the batch (buffer →
    the module writing it; ``reread_buffers``: those the forward reads again after writing) and
    notes (nothing proven, or refusals kept as notes)."""

    partial_grads: tuple[PartialGrad, ...] = ()
    readers: tuple[ParamReader, ...] = ()
    fresh_outputs: tuple[str, ...] = ()
    batch_buffers: tuple[tuple[str, str], ...] = ()
    reread_buffers: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Scope:
    """The plan's parallelism as the run needs it."""

    tp_axis: str | None
    tp_size: int
    sequence_parallel: bool
    data_parallel: bool = False
    context: bool = False
    resharded: tuple[str, ...] = ()  # FSDP units resharded after forward (ZeRO-3), not the root
    shared_inputs: bool = True  # plan/decisions.py: pair_inputs_shared


def prove_plan(
    model: nn.Module,
    params: Sequence[ParamLayout],
    styles: Sequence[ModuleStyle],
    scope: Scope,
    *,
    blocks: Sequence[str] = (),
    unproven: str = "refuse",
) -> Proof:
    """Run the abstract rank (see module doc) when the plan needs it. Raises
    :class:`~meshtrain.PlanError` for what would crash or train wrong, and when no probe can be
    built or the model's forward cannot run on fake tensors (nothing proven) unless
    ``unproven="note"`` (then a note says so)."""
    tensor_parallel = scope.tp_axis is not None and scope.tp_size > 1 and bool(styles)
    buffers = scope.data_parallel and bool(buffer_owners(model))
    if not (tensor_parallel or scope.context or buffers or scope.resharded):
        return Proof()
    if not tensor_parallel:
        scope, styles = replace(scope, tp_axis=None, tp_size=1, sequence_parallel=False), ()
    probe = probe_for(model, current_example(), tp_size=scope.tp_size)
    key = (
        tuple(styles),
        tuple(blocks),
        scope,
        probe_signature(probe),
        _KEPT_AS_NOTES[0],
        tuple(
            (p.fqn, p.shape, _tensor_parallel_dims(p, scope.tp_axis), p.trainable) for p in params
        ),
        tuple((fqn, tuple(t.shape), t.dtype) for fqn, t in model.named_parameters()),
    )
    known = _PROVEN.setdefault(model, {})
    if key not in known:
        known[key] = _prove(model, params, styles, scope, blocks, probe)
    proof = known[key]
    if isinstance(proof, PlanError):
        raise copy.copy(proof).with_traceback(None)
    unproven_notes = [n for n in proof.notes if n.startswith(_NOT_PROVEN)]
    if unproven_notes and not (tensor_parallel or scope.context or buffers):
        return Proof()  # only FSDP units' outputs to look at: a model the run cannot take is
        # planned as before (an in-place update of such an output then fails in FSDP2 itself)
    if unproven_notes and unproven == "refuse" and not _KEPT_AS_NOTES[0]:
        raise _refusal(unproven_notes[0], scope.tp_axis)
    return proof


def _tensor_parallel_dims(param: ParamLayout, axis: str | None) -> tuple[int, ...]:
    """The dims of ``param`` split over the tensor-parallel ``axis``: all the run reads of its
    spec (its local shape; whether it is sharded), so plans that differ only in how they shard
    over data axes (the ZeRO stage, FSDP's dim, the data degree) share one proven result."""
    if axis is None:
        return ()
    entries = param.spec.padded(len(param.shape))
    return tuple(dim for dim, entry in enumerate(entries) if axis in entry_axes(entry))


#: model → proven results per plan layout and probe, freed with the model (planning one model
#: many ways, as sizing does per checkpointing mode, runs it once per layout)
_PROVEN: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], Proof | PlanError]] = (
    weakref.WeakKeyDictionary()
)

#: whether refusals become notes (:func:`refusals_as_notes`)
_KEPT_AS_NOTES = [False]

_NOT_PROVEN = "shards not proven at plan time: "
_NO_PROBE = _NOT_PROVEN + "no probe: "


def _refusal(note: str, axis: str | None) -> PlanError:
    if note.startswith(_NO_PROBE):
        return no_probe(note.removeprefix(_NO_PROBE))
    return unproven(axis, note.removeprefix(_NOT_PROVEN))


@contextlib.contextmanager
def refusals_as_notes() -> Iterator[None]:
    """Plan what the abstract run would refuse, with each refusal as a note (to measure the
    proof's precision: ``benchmarks/proof_precision.py`` trains such plans against one device).
    Not for training: a refused plan crashes or trains wrong, which is why it is refused."""
    _KEPT_AS_NOTES[0], was = True, _KEPT_AS_NOTES[0]
    try:
        yield
    finally:
        _KEPT_AS_NOTES[0] = was


def kept_as_notes() -> bool:
    """Whether refusals are notes now (:func:`refusals_as_notes`)."""
    return _KEPT_AS_NOTES[0]


def _prove(
    model: nn.Module,
    params: Sequence[ParamLayout],
    styles: Sequence[ModuleStyle],
    scope: Scope,
    blocks: Sequence[str],
    probe: Probe | str,
) -> Proof | PlanError:
    if isinstance(probe, str):
        return Proof(notes=(_NO_PROBE + probe,))
    prover, effects = _prover(model, params, styles, scope)
    try:
        try:
            _run(model, prover, blocks, probe)
        except LookalikeRan:  # a look-alike block ran: again, each block with its own tensors
            prover, effects = _prover(model, params, styles, scope)
            prover.share_lookalikes = False
            _run(model, prover, blocks, probe)
    except Refused as refused:
        return _kept(refused.error)
    except PlanError as error:
        return _kept(error)
    except Exception as error:  # the model's own forward on fake inputs: nothing proven
        first = str(error).splitlines()[0] if str(error) else ""
        return Proof(
            notes=(
                f"shards not proven at plan time: the abstract forward on {probe.describe()} failed "
                f"in {prover.where()} ({type(error).__name__}: {first[:200]})",
            )
        )
    try:
        return _results(model, prover, effects)
    except PlanError as error:
        return _kept(error)


_COMPILED_SELECTIVE = (
    "torch.compile over checkpointed blocks passes as one replicated DTensor",
    "or train it without compile or with activation_checkpointing='none'",
)


def _kept(error: PlanError) -> Proof | PlanError:
    if _KEPT_AS_NOTES[0]:
        return Proof(notes=(f"refused (kept as a note): {error}",))
    return error


def _prover(
    model: nn.Module, params: Sequence[ParamLayout], styles: Sequence[ModuleStyle], scope: Scope
) -> tuple[Prover, Effects]:
    effects = Effects(context=scope.context, units=frozenset(scope.resharded))
    prover = Prover(
        model, params, styles, scope.tp_axis, scope.tp_size, scope.sequence_parallel, effects
    )
    if not scope.shared_inputs and not scope.sequence_parallel:
        effects.sequence_parallel, effects.why_dtensor = True, _COMPILED_SELECTIVE
    return prover, effects


def _run(model: nn.Module, prover: Prover, blocks: Sequence[str], probe: Probe) -> None:
    kept = _tensor_attributes(model)
    handles = prover.hook(blocks)
    quiet_log = logging.getLogger("torch._subclasses.fake_tensor")
    was_disabled, quiet_log.disabled = quiet_log.disabled, True  # failed candidates log errors
    try:
        with FakeTensorMode(allow_non_fake_inputs=False), torch.no_grad():
            state = prover.fake_state()
            args, kwargs = probe.make()
            prover.effects.taint((args, kwargs))
            with prover, prover.sizes:
                torch.func.functional_call(model, state, args, kwargs)
    finally:
        quiet_log.disabled = was_disabled
        for handle in handles:
            handle.remove()
        prover.restore()
        _drop_fake_attributes(model, kept)


def _results(model: nn.Module, prover: Prover, effects: Effects) -> Proof:
    partial = prover.partial_grads()
    owners = parameter_owners(model)
    readers = []
    for param, reader in _copied(effects.reads, prover.copies).items():
        if param in effects.sharded:
            raise sharded_read(param, reader, owners.get(param, ("",)), prover.axis)
        readers.append(ParamReader(param, reader))
    fresh = list(_copied({f: f for f in effects.fresh}, prover.copies))
    written = _copied(effects.written, prover.copies)
    reread = _copied({b: b for b in effects.reread}, prover.copies)
    return Proof(partial, tuple(readers), tuple(fresh), tuple(written.items()), tuple(reread))


def _copied(found: Mapping[str, str], copies: Mapping[str, str]) -> dict[str, str]:
    """``found`` (an FQN → a module FQN) with each entry under a block that ran also given to
    the look-alike blocks that passed their input through."""
    result = dict(found)
    for look_alike, representative in copies.items():
        prefix = representative + "."
        for key, value in found.items():
            if key.startswith(prefix):
                moved = value.startswith(prefix) or value == representative
                result[look_alike + key[len(representative) :]] = (
                    look_alike + value[len(representative) :] if moved else value
                )
    return dict(sorted(result.items()))


def _tensor_attributes(model: nn.Module) -> dict[tuple[str, str], Any]:
    """Every module's plain attributes by module and name: a forward may store a tensor in one
    (an MoE layer's last balance loss)."""
    return {
        (fqn, name): value
        for fqn, module in model.named_modules()
        for name, value in vars(module).items()
    }


def _drop_fake_attributes(model: nn.Module, kept: dict[tuple[str, str], Any]) -> None:
    """Undo what the abstract forward stored on modules: each fake tensor attribute is given its
    value from before the run back, or removed (the model is trained, copied and saved later)."""
    for fqn, module in model.named_modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, FakeTensor):
                if (fqn, name) in kept:
                    setattr(module, name, kept[fqn, name])
                else:
                    delattr(module, name)
