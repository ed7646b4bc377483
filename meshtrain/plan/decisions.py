"""What the ZeRO stage decides for an FSDP unit, decided once: :func:`fsdp_decisions`.

The plan records the result on each :class:`~meshtrain.plan.ir.FSDPUnit`; the cost model
(:mod:`~meshtrain.plan.cost`), pipeline planning and the lowering (``fully_shard`` or
``replicate``, reshard-after-forward, gradient sync per micro-batch, CPU offload) read it from
there instead of comparing ``zero`` again.

====  ===========  ======================  ==============  ======================  ===============
zero  wrapper      params, grads, states   reshard after   gradient sync           params kept
                   sharded at rest         forward         (on which micro-batch)  gathered across
                                           (non-root)                              micro-batches
====  ===========  ======================  ==============  ======================  ===============
0     replicate    no                      no              all-reduce, last        —
1     fully_shard  yes                     no              reduce-scatter, last    yes
2     fully_shard  yes                     no              reduce-scatter, every   no
3     fully_shard  yes                     yes             reduce-scatter, every   no
====  ===========  ======================  ==============  ======================  ===============

The root unit keeps its parameters gathered after forward (backward needs them first). Inside a
pipeline schedule the schedule itself syncs gradients (and reshards after backward) on a stage's
last micro-batch, whatever these say (see :mod:`~meshtrain.plan.pipeline.cost`).

Example:
    >>> d = fsdp_decisions(3, root=False)
    >>> d.wrapper, d.reshard_after_forward, d.grad_sync, d.sync_every_microbatch
    ('fully_shard', True, 'reduce_scatter', True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from meshtrain.errors import PlanError

Wrapper = Literal["fully_shard", "replicate"]
GradSync = Literal["reduce_scatter", "all_reduce"]


@dataclass(frozen=True)
class FSDPDecisions:
    """How one FSDP unit is wrapped and synchronised, as decided by :func:`fsdp_decisions`.

    ``wrapper``: ``fully_shard`` (FSDP2) or ``replicate`` (DDP-like). ``shard_params``,
    ``shard_grads``, ``shard_optimizer_states``: each kept as the rank's data-parallel shard at
    rest (else whole). ``reshard_after_forward``: the gathered parameters are freed after forward
    and gathered again in backward. ``grad_sync``: the gradient collective;
    ``sync_every_microbatch``: issued on every micro-batch (gradients stay sharded), else once
    per step on the last one (gradients accumulate whole). ``gathered_across_microbatches``: the
    parameters gathered for the first micro-batch stay gathered until the last one's backward.
    ``offload``: parameters, gradients and optimizer states live on the host (FSDP2's
    ``CPUOffloadPolicy``).
    """

    wrapper: Wrapper
    shard_params: bool
    shard_grads: bool
    shard_optimizer_states: bool
    reshard_after_forward: bool
    grad_sync: GradSync
    sync_every_microbatch: bool
    gathered_across_microbatches: bool
    offload: bool = False

    def to_json(self) -> dict[str, object]:
        """Plain data for the plan's JSON."""
        return dict(vars(self))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FSDPDecisions:
        """Inverse of :meth:`to_json`."""
        try:
            return cls(**data)
        except TypeError as error:
            raise PlanError(
                f"FSDP unit decisions {data!r} do not match this meshtrain's fields ({error}); "
                "plan the model again to write a current plan."
            ) from error

    def describe(self) -> str:
        """One line for ``Plan.explain()``.

        Example:
            >>> fsdp_decisions(1, root=True).describe()
            'fully_shard, params/grads/optimizer states sharded, kept after forward, reduce_scatter on the last micro-batch, gathered across micro-batches'
        """
        sharded = [
            name
            for name, flag in (
                ("params", self.shard_params),
                ("grads", self.shard_grads),
                ("optimizer states", self.shard_optimizer_states),
            )
            if flag
        ]
        parts = [
            self.wrapper,
            f"{'/'.join(sharded)} sharded" if sharded else "nothing sharded",
            "resharded after forward" if self.reshard_after_forward else "kept after forward",
            f"{self.grad_sync} "
            + ("every micro-batch" if self.sync_every_microbatch else "on the last micro-batch"),
        ]
        if self.gathered_across_microbatches:
            parts.append("gathered across micro-batches")
        if self.offload:
            parts.append("offloaded to the host")
        return ", ".join(parts)


def fsdp_decisions(zero: int, *, root: bool = False, offload: bool = False) -> FSDPDecisions:
    """What ZeRO stage ``zero`` (0–3) means for one FSDP unit (the table above); ``root``: the
    model's root unit, which keeps its parameters after forward; ``offload``: FSDP2's CPU
    offload (needs a sharded stage).

    Example:
        >>> fsdp_decisions(0).grad_sync, fsdp_decisions(0).shard_params
        ('all_reduce', False)
    """
    if isinstance(zero, bool) or zero not in (0, 1, 2, 3):
        raise PlanError(f"zero={zero!r} is out of range: use 0, 1, 2 or 3.")
    sharded = zero >= 1
    if offload and not sharded:
        raise PlanError(
            "offload=True needs sharded data parallelism (zero ≥ 1): FSDP2's CPU offload keeps "
            "each rank's shard on the host. Use zero=3 with offload."
        )
    return FSDPDecisions(
        wrapper="fully_shard" if sharded else "replicate",
        shard_params=sharded,
        shard_grads=sharded,
        shard_optimizer_states=sharded,
        reshard_after_forward=zero == 3 and not root,
        grad_sync="reduce_scatter" if sharded else "all_reduce",
        sync_every_microbatch=zero >= 2,
        gathered_across_microbatches=zero == 1,
        offload=offload,
    )


def pair_inputs_shared(compile_scope: str | None, activation_checkpointing: str) -> bool:
    """Whether a pair parent without sequence parallelism keeps its plain input (its column-wise
    Linears share one replicated DTensor of it) rather than taking it as that DTensor. Not where
    ``torch.compile`` traces checkpointed blocks: the sharing hooks keep Python state it cannot
    trace inside a checkpointed region (torch 2.13 fails at the first compiled forward,
    "Mixing fake modes").

    >>> pair_inputs_shared("model", "selective"), pair_inputs_shared(None, "selective")
    (False, True)
    """
    return compile_scope is None or activation_checkpointing == "none"
