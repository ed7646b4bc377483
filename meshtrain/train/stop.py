"""Stopping a run on request: a signal becomes a stop that every rank takes at the same step.

SIGTERM (what SLURM, Kubernetes and ``torchrun`` send before killing a job), SIGINT (Ctrl-C) and
SIGHUP, once the training loop has :meth:`~GracefulStop.arm`-ed the stop, set a flag; nothing is
interrupted. At each step boundary the loop calls :meth:`GracefulStop.agreed`, one all-reduce of
that flag: a signal that reached only some ranks, or reached them at different moments, still
stops every rank after the same step, so the checkpoint that follows is one collective save, not
a hang. A second signal changes nothing (the scheduler's own deadline, or ``torchrun``'s SIGKILL
after its shutdown timeout, is the hard stop). Before the loop starts there is nothing to save:
a signal raises :class:`~meshtrain.launch.StopRequested` at once, so a rank waiting at start-up
for a peer that died does not sit out the shutdown timeout.

Example (on every rank)::

    with GracefulStop().installed() as stop:
        ...                      # start-up: a signal raises StopRequested
        stop.arm()
        for batch in batches:
            if stop.agreed():
                break            # then save a checkpoint and exit with EXIT_STOPPED
            state, metrics = step(state, batch)

    >>> stop = GracefulStop()
    >>> stop.request(signal.SIGTERM)
    >>> stop.requested, signal_name(stop.requested)
    (15, 'SIGTERM')
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.launch import StopRequested

__all__ = ["STOP_SIGNALS", "GracefulStop", "signal_name"]

#: The signals that ask a run to stop after its current step.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def signal_name(number: int) -> str:
    """``SIGTERM`` for 15; ``signal 99`` for a number no signal has."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class GracefulStop:
    """A stop request from a signal (or from :meth:`request`), agreed on by every rank."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        self.signals = signals
        self.requested = 0  # the first signal number received; 0 while none
        self.armed = False

    def request(self, number: int) -> None:
        """Ask for a stop (what the signal handler does); the first request is kept."""
        self.requested = self.requested or int(number)

    def arm(self) -> None:
        """From now on a signal asks for a stop at the next step boundary; a stop requested
        before (with :meth:`request`) is taken there too."""
        self.armed = True

    def install(self) -> dict[int, Any]:
        """Handle :attr:`signals` from now on (main thread only); returns the handlers replaced.
        A process that ends after training keeps them: once armed, a late signal is harmless."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {number: signal.signal(number, self._handle) for number in self.signals}

    @contextlib.contextmanager
    def installed(self, enabled: bool = True) -> Iterator[GracefulStop]:
        """Handle :attr:`signals` inside the block (main thread only; elsewhere, or when not
        ``enabled``, signals keep their handlers); the previous handlers come back after it."""
        previous = self.install() if enabled else {}
        try:
            yield self
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)

    def agreed(self, device: torch.device | None = None) -> int:
        """The stop every rank takes now: the highest signal number any rank received (0: go
        on). A collective when a process group exists; call it on every rank at the same point."""
        if not (dist.is_available() and dist.is_initialized()):
            return self.requested
        flag = torch.tensor([self.requested], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def _handle(self, number: int, frame: FrameType | None) -> Any:
        self.request(number)
        if not self.armed:
            raise StopRequested(number)
