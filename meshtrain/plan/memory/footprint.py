"""What one rank of a plan holds and sends per step: the report ``meshtrain plan`` prints.

Memory comes from :class:`~meshtrain.plan.ir.Memory` (see ``meshtrain.plan.cost``), with the
activations of every checkpointing mode beside the plan's own. Communication is summed per mesh
axis and collective kind; besides the payload (the full tensor a collective handles) it gives the
bytes each rank sends over its links under the ring algorithms NCCL and gloo use:

==================  =====================================
collective          bytes each rank sends, axis of size n
==================  =====================================
``all_reduce``      2 (n − 1) / n × payload
``all_gather``      (n − 1) / n × payload (the gathered tensor)
``reduce_scatter``  (n − 1) / n × payload (the unreduced input)
``send/recv``       payload (to the neighbouring stage)
``all_to_all``      (n − 1) / n × payload (its larger buffer; uniform routing)
==================  =====================================

Example:
    >>> ring_bytes("all_reduce", 1000, 4)
    1500
    >>> ring_bytes("all_gather", 1000, 1)
    0
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from meshtrain.errors import PlanError
from meshtrain.plan.ir import Memory, Plan
from meshtrain.plan.memory.sizes import format_bytes

_RING = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "send/recv": lambda n: 1.0 if n > 1 else 0.0,
    "all_to_all": lambda n: (n - 1) / n,
}


def ring_bytes(kind: str, payload: int, axis_size: int) -> int:
    """Bytes each rank sends for one collective of ``kind`` over an axis of ``axis_size`` ranks."""
    if kind not in _RING:
        raise PlanError(f"no ring formula for collective {kind!r}; known: {sorted(_RING)}.")
    return round(_RING[kind](axis_size) * payload)


@dataclass(frozen=True)
class AxisTraffic:
    """Collectives of one kind on one mesh axis per step, for one rank."""

    axis: str
    axis_size: int
    kind: str
    count: int
    payload_bytes: int
    sent_bytes: int  # by the ring formula


@dataclass(frozen=True)
class Footprint:
    """One rank's memory and traffic per step under a plan, against the device's memory.

    ``activations_by_mode``: peak activation bytes per rank for 'none', 'full' and 'selective'
    checkpointing (the plan's own mode is in ``memory``); ``bubble_fraction``: idle share of a
    pipeline rank's time (0 without a pipeline).
    """

    mesh: dict[str, int]
    memory: Memory
    activations_by_mode: dict[str, int]
    checkpointing: str
    device_memory: int | None
    traffic: tuple[AxisTraffic, ...]
    bubble_fraction: float
    microbatches: int
    batch_size: int | None
    seq_len: int | None

    @property
    def fits(self) -> bool | None:
        """Whether the peak fits the device memory (None when none was given)."""
        return None if self.device_memory is None else self.memory.total <= self.device_memory

    def total_with(self, mode: str) -> int:
        """Peak bytes per rank had the plan used checkpointing ``mode`` instead."""
        return self.memory.total - self.memory.activations + self.activations_by_mode[mode]

    def sent_bytes(self, axis: str | None = None) -> int:
        """Bytes this rank sends per step (on one axis, or on all)."""
        return sum(t.sent_bytes for t in self.traffic if axis in (None, t.axis))

    def to_json(self) -> dict[str, object]:
        """Plain data, ``memory`` with its totals."""
        data = asdict(self)
        m = self.memory
        data["memory"].update(at_rest=m.at_rest, transient=m.transient, total=m.total)
        data["fits"] = self.fits
        return data

    def format(self) -> str:
        """The table ``meshtrain plan`` prints."""

        def gib(value: int) -> str:
            return format_bytes(value, "GiB")

        m = self.memory
        mesh = ", ".join(f"{axis}: {size}" for axis, size in self.mesh.items())
        batch = (
            f"{self.batch_size} sequence(s) × {self.seq_len} tokens per micro-batch per data-parallel"
            f" rank, {self.microbatches} micro-batch(es) per step"
            if self.batch_size and self.seq_len
            else "batch not given: activations and activation collectives not sized"
        )
        rows = [
            ("parameters (master copy)", m.params),
            ("gradients", m.grads),
            ("optimizer states", m.optimizer_states),
            ("buffers", m.buffers),
            ("gathered parameters (compute copies)", m.gathered_params),
            ("unsharded gradients (before reduce)", m.unsharded_grads),
            (f"activations ({self.checkpointing} checkpointing)", m.activations),
        ]
        lines = [f"mesh {{{mesh}}}; {batch}", "", "memory per rank (busiest rank):"]
        lines += [f"  {name:<40} {gib(value):>12}" for name, value in rows]
        lines.append(f"  {'total (peak)':<40} {gib(m.total):>12}")
        if self.device_memory is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(f"  {verdict} in {gib(self.device_memory)} per device")
        if self.activations_by_mode:
            lines += ["", "activations and peak total by checkpointing mode:"]
            for mode, value in self.activations_by_mode.items():
                fits = ""
                if self.device_memory is not None:
                    fits = "  fits" if self.total_with(mode) <= self.device_memory else "  too big"
                lines.append(
                    f"  {mode:<10} activations {gib(value):>12}   total {gib(self.total_with(mode)):>12}{fits}"
                )
        lines += ["", "communication per step, this rank (ring algorithm):"]
        lines.append(
            f"  {'axis':<6} {'size':>6}  {'collective':<15} {'count':>6}  "
            f"{'payload':>12}  {'sent':>12}"
        )
        for t in self.traffic:
            lines.append(
                f"  {t.axis:<6} {t.axis_size:>6}  {t.kind:<15} {t.count:>6}  "
                f"{gib(t.payload_bytes):>12}  {gib(t.sent_bytes):>12}"
            )
        if not self.traffic:
            lines.append("  none")
        lines.append(f"  {'total sent':<38} {gib(self.sent_bytes()):>12}")
        if self.bubble_fraction:
            lines += [
                "",
                f"pipeline bubble: {self.bubble_fraction:.1%} of each pipeline rank's time",
            ]
        return "\n".join(lines) + "\n"


def footprint(plan: Plan, device_memory: int | None = None) -> Footprint:
    """The :class:`Footprint` of ``plan`` on devices of ``device_memory`` bytes.

    Example:
        >>> import meshtrain as mt
        >>> from meshtrain.models import LlamaConfig, build_llama, default_rules
        >>> model = build_llama(LlamaConfig.debug(), device="meta")
        >>> mesh = mt.make_mesh(dp=4, tp=1, world_size=4, abstract=True)
        >>> report = footprint(mt.plan(model, mesh, default_rules(), zero=3), 2**30)
        >>> report.fits, report.memory.params == 4 * LlamaConfig.debug().num_params() // 4
        (True, True)
    """
    sizes = plan.mesh.shape
    traffic = []
    for (kind, axis), (count, payload) in plan.collective_totals().items():
        size = math.prod(sizes[name] for name in axis.split("+"))
        traffic.append(
            AxisTraffic(axis, size, kind, count, payload, ring_bytes(kind, payload, size))
        )
    pipeline = plan.pipeline
    return Footprint(
        mesh=dict(sizes),
        memory=plan.memory,
        activations_by_mode=dict(plan.activation_estimates),
        checkpointing=plan.options.activation_checkpointing,
        device_memory=device_memory,
        traffic=tuple(traffic),
        bubble_fraction=pipeline.bubble_fraction if pipeline is not None else 0.0,
        microbatches=plan.options.microbatches,
        batch_size=plan.options.batch_size,
        seq_len=plan.options.seq_len,
    )


def textbook_bytes(params: int, zero: int, ranks: int) -> float:
    """Per-rank bytes of mixed-precision Adam after the ZeRO paper (Rajbhandari et al. 2020):
    2 bytes of bf16 weights, 2 of bf16 gradients and 12 of fp32 master weights, momentum and
    variance per parameter — 16Φ unsharded, (4 + 12/N)Φ under ZeRO-1, (2 + 14/N)Φ under ZeRO-2,
    16Φ/N under ZeRO-3. The planner's figures differ where FSDP2 does (docs/sizing.md).

    Example:
        >>> textbook_bytes(7 * 10**9, 0, 8) / 1e9, textbook_bytes(7 * 10**9, 3, 8) / 1e9
        (112.0, 14.0)
    """
    weights, grads, states = 2.0 * params, 2.0 * params, 12.0 * params
    if zero >= 1:
        states /= ranks
    if zero >= 2:
        grads /= ranks
    if zero >= 3:
        weights /= ranks
    return weights + grads + states
