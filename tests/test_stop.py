"""Stop signals, in process and on real gloo ranks: before training starts a signal ends the
rank at once (nothing to save); once the loop has armed the stop it only asks for one, and the
ranks agree on it at a step boundary even when the signal reached one rank only."""

from __future__ import annotations

import signal

import pytest

from meshtrain.launch import StopRequested
from meshtrain.testing.runner import get_pool
from meshtrain.train.stop import STOP_SIGNALS, GracefulStop, signal_name


@pytest.mark.parametrize("number", STOP_SIGNALS, ids=[s.name for s in STOP_SIGNALS])
def test_before_the_loop_a_signal_stops_at_once(number: signal.Signals) -> None:
    stop = GracefulStop()
    with stop.installed(), pytest.raises(StopRequested) as raised:
        signal.raise_signal(number)
    assert raised.value.signal_name == number.name and stop.requested == number


@pytest.mark.parametrize("number", STOP_SIGNALS, ids=[s.name for s in STOP_SIGNALS])
def test_once_armed_a_signal_only_asks_and_the_first_one_is_kept(number: signal.Signals) -> None:
    stop = GracefulStop()
    with stop.installed():
        stop.arm()
        signal.raise_signal(number)
        signal.raise_signal(signal.SIGTERM if number != signal.SIGTERM else signal.SIGINT)
    assert stop.agreed() == number and signal_name(stop.agreed()) == number.name


def test_the_previous_handlers_come_back_after_the_block() -> None:
    before = {number: signal.getsignal(number) for number in STOP_SIGNALS}
    with GracefulStop().installed():
        assert all(signal.getsignal(number) != before[number] for number in STOP_SIGNALS)
    assert {number: signal.getsignal(number) for number in STOP_SIGNALS} == before
    with GracefulStop().installed(enabled=False):
        assert {number: signal.getsignal(number) for number in STOP_SIGNALS} == before


def signal_one_rank(rank_signalled: int) -> list[int]:
    """On every rank: arm a stop, deliver SIGTERM to one rank only, agree twice."""
    import torch.distributed as dist

    stop = GracefulStop()
    with stop.installed():
        stop.arm()
        first = stop.agreed()
        if dist.get_rank() == rank_signalled:
            signal.raise_signal(signal.SIGTERM)
        return [first, stop.agreed()]


@pytest.mark.spmd
def test_a_signal_on_one_rank_stops_every_rank_at_the_same_point() -> None:
    assert get_pool(2).run(signal_one_rank, 1) == [[0, signal.SIGTERM]] * 2
