"""Where a training run's metrics go: the console, a JSONL file, wandb, and the run's plan files.

Every rank calls the same three methods; only the logging rank (rank 0 unless told otherwise)
gets real sinks, every other rank gets an empty :class:`Sinks` whose methods do nothing. The loss
and gradient norm arrive already reduced to global values on every rank, so one rank is enough.

Example (the train loop, on every rank)::

    sinks = make_sinks(LoggingConfig(), run_dir=Path("runs/debug"), rank=dist.get_rank(),
                       total_steps=100, run_name="debug")
    sinks.start(config=recipe_as_dict, plan_text=plan.explain(), plan_json=plan.to_json())
    for step in range(1, 101):
        ...
        sinks.log(step, {"loss": loss, "grad_norm": norm, "lr": lr, "tokens": n})
    sinks.close()

Modules: :mod:`~meshtrain.train.metrics.config` (:class:`LoggingConfig`),
:mod:`~meshtrain.train.metrics` (console, JSONL, run files), and
:mod:`~meshtrain.train.metrics.wandb_sink` (wandb, imported only when a run uses it).
"""

from meshtrain.train.metrics.config import WANDB_MODES, LoggingConfig
from meshtrain.train.metrics.sinks import (
    METRICS_FILE,
    ConsoleSink,
    JsonlSink,
    RunFilesSink,
    Sink,
    Sinks,
    format_metrics,
    make_sinks,
    read_jsonl,
    truncate_jsonl,
)
from meshtrain.train.metrics.wandb_sink import (
    WANDB_RUN_ID_FILE,
    WandbSink,
    check_wandb_credentials,
)

__all__ = [
    "METRICS_FILE",
    "WANDB_MODES",
    "WANDB_RUN_ID_FILE",
    "ConsoleSink",
    "JsonlSink",
    "LoggingConfig",
    "RunFilesSink",
    "Sink",
    "Sinks",
    "WandbSink",
    "check_wandb_credentials",
    "format_metrics",
    "make_sinks",
    "read_jsonl",
    "truncate_jsonl",
]
