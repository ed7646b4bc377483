"""Step time, tokens per second, memory and model FLOPs utilisation for the training loop.

The loop hands :meth:`Throughput.update` the step's metrics (with ``"tokens"``: the global number
of tokens trained on in this step) and gets them back with timing and memory added, ready for
:class:`meshtrain.train.metrics.Sinks`. Keys added:

- ``step_time_s``: wall time since the previous ``update`` (the first step: since construction or
  :meth:`Throughput.reset_timer`, so it includes warm-up such as compilation);
- ``warmup``: True for the first ``warmup_steps`` steps, whose timings averages should skip;
- ``tokens_per_s``: global tokens of this step / ``step_time_s`` (when ``"tokens"`` is given);
- ``cuda_memory_gib``: peak CUDA memory allocated by this process (GiB), on a CUDA device, or
  ``rss_gib``: this process's peak resident set size (GiB) elsewhere;
- ``mfu``: model FLOPs utilisation, on CUDA only, when FLOPs per token and the GPU's peak are known.

MFU = tokens/s × FLOPs per token / (peak bf16 dense FLOP/s per GPU × number of GPUs). FLOPs per
token come from the model (:func:`meshtrain.models.llama_flops_per_token` for meshtrain's
Llama); the peak comes
from :func:`peak_bf16_flops` by ``torch.cuda.get_device_name()``.

Example:
    >>> ticks = iter([0.0, 2.0, 3.0])
    >>> meter = Throughput(clock=lambda: next(ticks))
    >>> meter.update({"tokens": 4096})["tokens_per_s"]  # warm-up step: 2 s
    2048.0
    >>> meter.update({"tokens": 4096})["tokens_per_s"]
    4096.0
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.errors import MeshtrainError

_LOGGER = logging.getLogger(__name__)
_GIB = 2**30

# Peak dense (no sparsity) bf16 tensor-core FLOP/s per GPU, from the vendors' data sheets; the
# sheets quote "with sparsity" figures twice these. Matched in order against
# torch.cuda.get_device_name(): the first entry whose every substring occurs wins.
_PEAK_BF16_FLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H100", "NVL"), 835e12),  # NVIDIA H100 NVL data sheet: 1,671 TFLOPS sparse
    (("H100", "PCIe"), 756e12),  # NVIDIA H100 PCIe data sheet: 1,513 TFLOPS sparse
    (("H100",), 989e12),  # NVIDIA H100 SXM5 data sheet: 1,979 TFLOPS sparse
    (("H200", "NVL"), 835e12),  # NVIDIA H200 NVL data sheet: 1,671 TFLOPS sparse
    (("H200",), 989e12),  # NVIDIA H200 SXM data sheet: 1,979 TFLOPS sparse (also GH200)
    (("B200",), 2250e12),  # NVIDIA HGX B200 data sheet: 36 PFLOPS sparse for 8 GPUs
    (("A100",), 312e12),  # NVIDIA A100 data sheet (SXM and PCIe): 624 TFLOPS sparse
    (("L40S",), 362e12),  # NVIDIA L40S data sheet: 362.05 TFLOPS dense, 733 sparse
    (("L4",), 121e12),  # NVIDIA L4 data sheet: 242 TFLOPS sparse
    (("A10",), 125e12),  # NVIDIA A10 data sheet: 250 TFLOPS sparse
    (("MI300X",), 1307e12),  # AMD Instinct MI300X data sheet: 1,307.4 TFLOPS dense
)


def peak_bf16_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of one GPU named as ``torch.cuda.get_device_name()`` names it.

    None for a GPU not in the table: MFU is then not reported (pass ``peak_flops_per_device`` to
    :class:`Throughput` to report it anyway).

    Example:
        >>> peak_bf16_flops("NVIDIA H100 80GB HBM3")
        989000000000000.0
        >>> peak_bf16_flops("NVIDIA H100 PCIe"), peak_bf16_flops("Some Future GPU")
        (756000000000000.0, None)
    """
    for substrings, flops in _PEAK_BF16_FLOPS:
        if all(substring in device_name for substring in substrings):
            return flops
    return None


def model_flops_utilization(
    tokens_per_s: float, flops_per_token: float, peak_flops_per_device: float, world_size: int
) -> float:
    """Fraction of the devices' peak FLOP/s the model's FLOPs use.

    Example:
        >>> model_flops_utilization(1000.0, 6e9, peak_flops_per_device=1e13, world_size=2)
        0.3
    """
    return tokens_per_s * flops_per_token / (peak_flops_per_device * world_size)


def peak_rss_gib() -> float | None:
    """Peak resident set size of this process in GiB (None where ``resource`` cannot tell).

    Example:
        >>> peak_rss_gib() > 0
        True
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if peak <= 0:
        return None
    bytes_per_unit = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return peak * bytes_per_unit / _GIB


class Throughput:
    """Times steps and adds throughput, memory and MFU to each step's metrics.

    Construct it just before the first step; call :meth:`update` once per optimizer step on every
    rank (it issues no collectives) and :meth:`reset_timer` after work that is not training (a
    checkpoint save, an evaluation) so it does not count as step time.

    Args:
        flops_per_token: training FLOPs per token of the whole model (e.g.
            :func:`meshtrain.models.llama_flops_per_token`); MFU needs it.
        device: the device the model trains on; memory and MFU are CUDA's when it is a CUDA device.
        world_size: number of devices sharing the global tokens (default: the process group's
            size, or 1 without one).
        warmup_steps: leading steps marked ``warmup`` (compilation, allocator warm-up).
        peak_flops_per_device: overrides the table lookup by GPU name.
        clock: seconds as a float; tests pass a fake one.

    Example:
        >>> ticks = iter([10.0, 10.5])
        >>> metrics = Throughput(clock=lambda: next(ticks)).update({"loss": 2.0, "tokens": 100})
        >>> metrics["step_time_s"], metrics["tokens_per_s"], metrics["warmup"], "mfu" in metrics
        (0.5, 200.0, True, False)
    """

    def __init__(
        self,
        *,
        flops_per_token: float | None = None,
        device: torch.device | str = "cpu",
        world_size: int | None = None,
        warmup_steps: int = 1,
        peak_flops_per_device: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if warmup_steps < 0:
            raise MeshtrainError(
                f"Throughput(warmup_steps={warmup_steps}) must be >= 0: it is how many leading "
                "steps are marked as warm-up."
            )
        self.device = torch.device(device)
        self.world_size = world_size if world_size is not None else _default_world_size()
        self.flops_per_token = flops_per_token
        self.warmup_steps = warmup_steps
        self.on_cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.peak_flops_per_device = peak_flops_per_device
        if self.on_cuda and peak_flops_per_device is None:
            self.peak_flops_per_device = self._lookup_peak()
        self._clock = clock
        self._last_time = clock()
        self._steps = 0
        self._measured_time_s = 0.0
        self._measured_tokens = 0.0
        self._measured_steps = 0

    def reset_timer(self) -> None:
        """Start the next step's timing now (after a checkpoint save or evaluation)."""
        self._last_time = self._clock()

    def update(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """``metrics`` with step time, tokens/s, memory and (on CUDA) MFU added (module docstring)."""
        now = self._clock()
        step_time_s = now - self._last_time
        self._last_time = now
        warmup = self._steps < self.warmup_steps
        self._steps += 1
        result = dict(metrics)
        result["step_time_s"] = step_time_s
        result["warmup"] = warmup
        tokens = metrics.get("tokens")
        tokens_per_s = None
        if tokens is not None and step_time_s > 0:
            tokens_per_s = float(tokens) / step_time_s
            result["tokens_per_s"] = tokens_per_s
        if not warmup:
            self._measured_steps += 1
            self._measured_time_s += step_time_s
            self._measured_tokens += float(tokens or 0)
        result.update(self._memory())
        if tokens_per_s is not None and self._can_report_mfu():
            assert self.flops_per_token is not None and self.peak_flops_per_device is not None
            result["mfu"] = model_flops_utilization(
                tokens_per_s, self.flops_per_token, self.peak_flops_per_device, self.world_size
            )
        return result

    def summary(self) -> dict[str, float]:
        """Means over the steps after warm-up: ``mean_step_time_s`` and ``mean_tokens_per_s``.

        Empty while every step so far was a warm-up step.
        """
        if not self._measured_steps or self._measured_time_s <= 0:
            return {}
        summary = {"mean_step_time_s": self._measured_time_s / self._measured_steps}
        if self._measured_tokens:
            summary["mean_tokens_per_s"] = self._measured_tokens / self._measured_time_s
        return summary

    def _can_report_mfu(self) -> bool:
        return (
            self.on_cuda
            and self.flops_per_token is not None
            and self.peak_flops_per_device is not None
        )

    def _memory(self) -> dict[str, float]:
        if self.on_cuda:
            return {"cuda_memory_gib": torch.cuda.max_memory_allocated(self.device) / _GIB}
        rss = peak_rss_gib()
        return {} if rss is None else {"rss_gib": rss}

    def _lookup_peak(self) -> float | None:
        name = torch.cuda.get_device_name(self.device)
        peak = peak_bf16_flops(name)
        if peak is None:
            _LOGGER.warning(
                "MFU is not reported: no peak bf16 FLOP/s is known for GPU %r. Pass "
                "Throughput(peak_flops_per_device=...) with its dense bf16 peak to report it.",
                name,
            )
        return peak


def _default_world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1
