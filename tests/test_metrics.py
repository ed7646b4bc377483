"""Metrics sinks (console, JSONL, wandb, run files) and throughput/MFU arithmetic, in process.

The one wandb test opens a single offline run (~0.6 s) and reads its transaction log back with
:func:`_read_wandb_records` to prove the metrics, config and plan files landed in the run.
"""

from __future__ import annotations

import io
import json
import math
import os
import signal
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.errors import ConfigError, MeshtrainError
from meshtrain.models import llama_flops_per_token
from meshtrain.models.llama import LlamaConfig, build_llama
from meshtrain.train.metrics import (
    METRICS_FILE,
    WANDB_RUN_ID_FILE,
    ConsoleSink,
    JsonlSink,
    LoggingConfig,
    Sinks,
    WandbSink,
    check_wandb_credentials,
    format_metrics,
    make_sinks,
    read_jsonl,
    truncate_jsonl,
)
from meshtrain.train.throughput import (
    Throughput,
    model_flops_utilization,
    peak_bf16_flops,
)

PLAN_TEXT = "Plan for Llama on mesh {dp: 2}\n  layers.0.attention.wq.weight  P('dp', None)"
PLAN_JSON = json.dumps({"mesh": {"dp": 2}, "params": [{"fqn": "output.weight", "spec": [None]}]})
STEP_METRICS = [
    {"loss": 2.5, "grad_norm": 1.25, "lr": 1e-3, "tokens": 4096, "skipped": 0},
    {"loss": 2.25, "grad_norm": 0.75, "lr": 1e-3, "tokens": 4096, "skipped": 0},
    {"loss": 2.0, "grad_norm": 0.5, "lr": 5e-4, "tokens": 4096, "skipped": 1},
]


def _fake_clock(*ticks: float) -> Any:
    times = iter(ticks)
    return lambda: next(times)


def _config(**overrides: Any) -> LoggingConfig:
    return LoggingConfig(**{"console": False, "jsonl": False, "wandb": "disabled", **overrides})


# --- JSONL ---------------------------------------------------------------------------------------


def test_jsonl_rows_round_trip_and_are_on_disk_before_close(tmp_path: Path) -> None:
    path = tmp_path / "run" / METRICS_FILE
    sink = JsonlSink(path)
    sink.start(config={}, plan_text="", plan_json="{}")
    sink.log(1, {"loss": 2.5, "tokens": 4096, "warmup": True, "note": "first"})
    sink.log(2, {"loss": torch.tensor(2.25), "mfu": None})
    rows = read_jsonl(path)  # flushed per line: readable while the sink is still open
    sink.close()
    assert [row["step"] for row in rows] == [1, 2]
    assert rows[0] | {"time": 0} == {
        "step": 1,
        "time": 0,
        "loss": 2.5,
        "tokens": 4096,
        "warmup": True,
        "note": "first",
    }
    assert rows[1]["loss"] == 2.25 and rows[1]["mfu"] is None
    assert all(isinstance(row["time"], float) and row["time"] > 1e9 for row in rows)


def test_jsonl_appends_on_resume_and_skips_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / METRICS_FILE
    for step in (1, 2):
        sink = JsonlSink(path)
        sink.log(step, {"loss": float(step)})
        sink.close()
    with path.open("a", encoding="utf-8") as file:
        file.write('{"step": 3, "loss"')  # a crash in the middle of a write
    assert [(row["step"], row["loss"]) for row in read_jsonl(path)] == [(1, 1.0), (2, 2.0)]


def test_a_resumed_run_drops_the_rows_past_its_checkpoint_so_no_step_repeats(
    tmp_path: Path,
) -> None:
    path = tmp_path / METRICS_FILE
    first = JsonlSink(path)
    first.start(config={}, plan_text="", plan_json="{}")
    for step in range(1, 8):  # a crash after step 7; the last checkpoint was at step 5
        first.log(step, {"loss": float(step)})
    first.close()
    with path.open("a", encoding="utf-8") as file:
        file.write('{"step": 8, "lo')
    resumed = JsonlSink(path, start_step=5)
    resumed.start(config={}, plan_text="", plan_json="{}")
    for step in range(6, 9):
        resumed.log(step, {"loss": step + 0.5})
    resumed.close()
    rows = read_jsonl(path)
    assert [row["step"] for row in rows] == list(range(1, 9))
    assert [row["loss"] for row in rows[4:]] == [5.0, 6.5, 7.5, 8.5]
    assert truncate_jsonl(path, 8) == 0 and truncate_jsonl(tmp_path / "none.jsonl", 0) == 0
    fresh = JsonlSink(path, start_step=0)  # a fresh start in the same directory
    fresh.start(config={}, plan_text="", plan_json="{}")
    fresh.close()
    assert read_jsonl(path) == []


def test_read_jsonl_names_the_broken_line(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(MeshtrainError, match=r"m\.jsonl:2 is not a JSON object"):
        read_jsonl(path)
    path.write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(MeshtrainError, match=r"m\.jsonl:2 holds list"):
        read_jsonl(path)


def test_jsonl_refuses_values_it_cannot_record(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / METRICS_FILE)
    with pytest.raises(MeshtrainError, match=r"metric 'grads' is a Tensor"):
        sink.log(1, {"grads": torch.ones(3)})
    sink.close()


_VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**62), max_value=2**62),
    st.booleans(),
    st.none(),
    st.text(max_size=8),
)


@settings(max_examples=25)
@given(st.dictionaries(st.from_regex(r"[a-z_]{1,8}", fullmatch=True), _VALUES, max_size=5))
def test_jsonl_sink_file_round_trips(metrics: dict[str, Any]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as run_dir:
        sink = JsonlSink(Path(run_dir) / METRICS_FILE)
        sink.log(7, metrics)
        sink.close()
        (row,) = read_jsonl(sink.path)
    assert row.pop("step") == 7 and isinstance(row.pop("time"), float)
    assert set(row) == set(metrics)
    for key, value in metrics.items():
        if isinstance(value, float) and math.isnan(value):
            assert math.isnan(row[key])
        else:
            assert row[key] == value and type(row[key]) is type(value)


# --- console and ranks ---------------------------------------------------------------------------


def test_console_prints_plain_lines_without_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sinks = make_sinks(
        _config(console=True), run_dir=tmp_path, rank=0, total_steps=3, run_name="debug"
    )
    sinks.start(config={}, plan_text=PLAN_TEXT, plan_json=PLAN_JSON)
    meter = Throughput(clock=_fake_clock(0.0, 2.0, 3.0, 4.0))
    for step, metrics in enumerate(STEP_METRICS, start=1):
        sinks.log(step, meter.update(metrics))
    sinks.close()
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "run debug: 3 steps"
    assert lines[1].startswith(
        "step 1/3 | loss 2.5000 | grad_norm 1.25 | lr 1.00e-03 | tok/s 2,048 | rss "
    )
    assert lines[1].endswith(" GiB | 2.000 s/step")
    assert lines[3].startswith("step 3/3 | loss 2.0000 | grad_norm 0.5 | lr 5.00e-04 | tok/s 4,096")
    assert lines[3].endswith("1.000 s/step | skipped 1")
    assert len(lines) == 4 and "\x1b" not in out and "\r" not in out


def test_log_every_keeps_first_multiples_and_last(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(console=True, jsonl=True, log_every=4)
    sinks = make_sinks(config, run_dir=tmp_path, rank=0, total_steps=10, run_name="x")
    sinks.start()
    for step in range(1, 11):
        sinks.log(step, {"loss": 1.0 / step})
    sinks.close()
    printed = [line.split(" |")[0] for line in capsys.readouterr().out.splitlines()[1:]]
    assert printed == ["step 1/10", "step 4/10", "step 8/10", "step 10/10"]
    assert [row["step"] for row in read_jsonl(tmp_path / METRICS_FILE)] == [1, 4, 8, 10]


def test_non_logging_ranks_print_and_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = LoggingConfig(console=True, jsonl=True, wandb="offline")
    run_dir = tmp_path / "run"
    for rank in (1, 3):
        sinks = make_sinks(config, run_dir=run_dir, rank=rank, total_steps=3, run_name="x")
        assert not sinks.enabled
        with sinks:
            sinks.start(config={"a": 1}, plan_text=PLAN_TEXT, plan_json=PLAN_JSON)
            sinks.log(1, STEP_METRICS[0])
    assert capsys.readouterr() == ("", "")
    assert not run_dir.exists()


def test_logging_rank_can_be_another_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(console=True)
    quiet = make_sinks(
        config, run_dir=tmp_path, rank=0, total_steps=2, run_name="x", logging_rank=1
    )
    loud = make_sinks(config, run_dir=tmp_path, rank=1, total_steps=2, run_name="x", logging_rank=1)
    assert not quiet.enabled and loud.enabled
    loud.start()
    loud.log(2, {"loss": 0.5})
    loud.close()
    assert capsys.readouterr().out.splitlines()[-1] == "step 2/2 | loss 0.5000"


class _TerminalBuffer(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_console_on_a_terminal_draws_a_bar_and_keeps_the_lines() -> None:
    stream = _TerminalBuffer()
    console = ConsoleSink(2, run_name="debug", stream=stream)
    console.start(config={}, plan_text="", plan_json="{}")
    console.log(1, {"loss": 2.5})
    console.log(2, {"loss": 2.25})
    console.close()
    out = stream.getvalue()
    assert "step 1/2 | loss 2.5000" in out and "step 2/2 | loss 2.2500" in out
    assert "2/2" in out.replace("step 2/2", "")  # the bar's own step counter


def test_format_metrics_shows_cuda_memory_and_mfu_when_present() -> None:
    line = format_metrics(5, {"loss": 1.0, "cuda_memory_gib": 31.25, "mfu": 0.4567}, 10)
    assert line == "step 5/10 | loss 1.0000 | cuda 31.25 GiB | mfu 45.7%"
    assert format_metrics(1, {"loss": None, "mfu": None, "skipped": 0}) == "step 1"


def test_sinks_close_every_sink_and_mark_failure(capsys: pytest.CaptureFixture[str]) -> None:
    class Broken:
        def start(self, *, config: Any, plan_text: str, plan_json: str) -> None: ...
        def log(self, step: int, metrics: Any) -> None: ...
        def close(self, *, failed: bool = False) -> None:
            raise OSError("disk full")

    console = ConsoleSink(5, run_name="r")
    with pytest.raises(OSError, match="disk full"), Sinks([Broken(), console]):
        raise ValueError("step failed")
    assert capsys.readouterr().out == "run r: stopped by an error\n"


def test_a_sink_failing_to_start_closes_those_already_started() -> None:
    class Unstartable:
        def start(self, *, config: Any, plan_text: str, plan_json: str) -> None:
            raise OSError("read-only file system")

        def log(self, step: int, metrics: Any) -> None: ...
        def close(self, *, failed: bool = False) -> None: ...

    stream = _TerminalBuffer()
    console = ConsoleSink(3, run_name="r", stream=stream)
    with pytest.raises(OSError, match="read-only"):
        Sinks([console, Unstartable()]).start()
    assert console._progress is None  # the bar (and its refresh thread) stopped
    assert stream.getvalue().rstrip().endswith("run r: stopped by an error")


# --- run files and wandb -------------------------------------------------------------------------


def test_start_writes_the_plan_and_config_files(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    sinks = make_sinks(_config(), run_dir=run_dir, rank=0, total_steps=1, run_name="x")
    sinks.start(config={"train": {"lr": 0.001}}, plan_text=PLAN_TEXT, plan_json=PLAN_JSON)
    sinks.close()
    assert (run_dir / "plan.txt").read_text() == PLAN_TEXT + "\n"
    assert json.loads((run_dir / "plan.json").read_text()) == json.loads(PLAN_JSON)
    assert json.loads((run_dir / "config.json").read_text()) == {"train": {"lr": 0.001}}
    assert sorted(path.name for path in run_dir.iterdir()) == [
        "config.json",
        "plan.json",
        "plan.txt",
    ]


def test_start_refuses_a_plan_json_that_is_not_json(tmp_path: Path) -> None:
    sinks = make_sinks(_config(), run_dir=tmp_path, rank=0, total_steps=1, run_name="x")
    with pytest.raises(MeshtrainError, match=r"plan_json .* is not JSON.*plan\.to_json\(\)"):
        sinks.start(plan_text=PLAN_TEXT, plan_json="Plan(...)")


def test_disabled_wandb_writes_nothing(tmp_path: Path) -> None:
    sinks = make_sinks(
        LoggingConfig(console=False, wandb="disabled"),
        run_dir=tmp_path,
        rank=0,
        total_steps=2,
        run_name="x",
    )
    assert not any(isinstance(sink, WandbSink) for sink in sinks.sinks)
    sinks.start(config={}, plan_text=PLAN_TEXT, plan_json=PLAN_JSON)
    sinks.log(1, STEP_METRICS[0])
    sinks.close()
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "config.json",
        METRICS_FILE,
        "plan.json",
        "plan.txt",
    ]


def _read_wandb_records(path: Path) -> list[Any]:
    """Records of a wandb transaction log: a 7-byte file header, then LevelDB-log chunks
    (checksum u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb transaction log"
    records, pending, position = [], b"", 7
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:  # block trailer too short for a header: skip it
            position += 32768 - position % 32768
            continue
        _, length, chunk_type = struct.unpack("<IHB", data[position : position + 7])
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if chunk_type in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.fixture
def offline_wandb_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """No key, no usable server, wandb's own files under tmp_path; wandb torn down afterwards."""
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_SERVICE", "WANDB_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # closed port: any call would fail
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    yield
    import wandb

    wandb.teardown()


def test_offline_wandb_run_holds_metrics_config_and_plan(
    tmp_path: Path, offline_wandb_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    config = LoggingConfig(console=False, jsonl=True, wandb="offline", wandb_project="tests")
    recipe = {"model": {"preset": "debug"}, "train": {"lr": 0.001, "steps": 3}}
    meter = Throughput(clock=_fake_clock(0.0, 1.0, 2.0, 3.0))
    with make_sinks(config, run_dir=run_dir, rank=0, total_steps=3, run_name="debug") as sinks:
        sinks.start(config=recipe, plan_text=PLAN_TEXT, plan_json=PLAN_JSON)
        for step, metrics in enumerate(STEP_METRICS, start=1):
            sinks.log(step, meter.update(metrics))
    assert capsys.readouterr() == ("", "")  # silent, and no console capture
    import wandb

    wandb.teardown()  # the service exits only after its writer has flushed the run's log

    (offline_run,) = (run_dir / "wandb").glob("offline-run-*")
    assert (offline_run / "files" / "plan.txt").read_text() == PLAN_TEXT + "\n"
    assert json.loads((offline_run / "files" / "plan.json").read_text()) == json.loads(PLAN_JSON)
    (log_file,) = offline_run.glob("run-*.wandb")
    records = _read_wandb_records(log_file)
    by_kind: dict[str, list[Any]] = {}
    for record in records:
        by_kind.setdefault(record.WhichOneof("record_type"), []).append(record)

    (run_record,) = by_kind["run"]
    assert run_record.run.display_name == "debug" and run_record.run.project == "tests"
    run_config = {item.key: json.loads(item.value_json) for item in run_record.run.config.update}
    assert run_config["plan"] == json.loads(PLAN_JSON)
    assert run_config["train"] == recipe["train"] and run_config["model"] == recipe["model"]

    saved = {file.path for record in by_kind["files"] for file in record.files.files}
    assert {"plan.txt", "plan.json"} <= saved

    history = [
        {item.nested_key[0]: json.loads(item.value_json) for item in record.history.item}
        for record in by_kind["history"]
    ]
    assert [row["_step"] for row in history] == [1, 2, 3]
    assert [row["loss"] for row in history] == [2.5, 2.25, 2.0]
    assert [row["tokens_per_s"] for row in history] == [4096.0, 4096.0, 4096.0]
    assert [row["skipped"] for row in history] == [0, 0, 1]
    assert "exit" in by_kind  # finish() completed the run
    assert [row["loss"] for row in read_jsonl(run_dir / METRICS_FILE)] == [2.5, 2.25, 2.0]


def test_a_resumed_run_continues_its_wandb_run_and_a_fresh_start_begins_a_new_one(
    tmp_path: Path, offline_wandb_env: None
) -> None:
    run_dir = tmp_path / "run"
    config = LoggingConfig(console=False, jsonl=False, wandb="offline", wandb_project="tests")
    ids = []
    for start_step in (0, 3, 0):
        with make_sinks(
            config, run_dir=run_dir, rank=0, total_steps=6, run_name="debug", start_step=start_step
        ) as sinks:
            sinks.start(config={}, plan_text=PLAN_TEXT, plan_json=PLAN_JSON)
            sinks.log(start_step + 1, STEP_METRICS[0])
            (wandb_sink,) = [sink for sink in sinks.sinks if isinstance(sink, WandbSink)]
            ids.append(wandb_sink.run.id)
    assert ids[0] == ids[1] != ids[2]
    assert (run_dir / WANDB_RUN_ID_FILE).read_text().strip() == ids[2]
    import wandb

    wandb.teardown()
    runs = [path.name for path in (run_dir / "wandb").glob("offline-run-*")]
    assert len(runs) == 3  # the first two under one run id, the third under another
    assert sum(ids[0] in name for name in runs) == 2 and sum(ids[2] in name for name in runs) == 1


def test_online_wandb_without_credentials_fails_on_every_rank_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    netrc_path = tmp_path / "netrc"
    netrc_path.write_text("machine example.com login user password secret\n")
    monkeypatch.setenv("NETRC", str(netrc_path))
    config = LoggingConfig(wandb="online", wandb_project="llama")
    for rank in (0, 1):
        with pytest.raises(ConfigError) as raised:
            make_sinks(config, run_dir=tmp_path / "run", rank=rank, total_steps=3, run_name="x")
        message = str(raised.value)
        assert "logging.wandb = 'online'" in message and "'llama'" in message
        assert "WANDB_API_KEY" in message and "wandb login" in message
        assert "'offline'" in message and "'api.wandb.ai'" in message
    assert not (tmp_path / "run").exists()

    netrc_path.write_text("machine api.wandb.ai login user password 0123456789abcdef\n")
    check_wandb_credentials(config)  # `wandb login` wrote an entry for the server
    netrc_path.write_text("")
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef")
    check_wandb_credentials(config)
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")
    with pytest.raises(ConfigError, match=r"'wandb\.example\.com'"):
        check_wandb_credentials(config)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"wandb": "Offline"}, r"LoggingConfig\(wandb='Offline'\): not a wandb mode"),
        ({"log_every": 0}, r"LoggingConfig\(log_every=0\): give 1 or more"),
        ({"log_every": 2.5}, r"LoggingConfig\(log_every=2.5\): give a positive integer"),
        ({"wandb_project": ""}, r"LoggingConfig\(wandb_project=''\): name the wandb project"),
    ],
)
def test_logging_config_rejects_bad_values(overrides: dict[str, Any], message: str) -> None:
    """The train layer raises its own error (a recipe's [logging] is checked by the schema)."""
    with pytest.raises(ConfigError, match=message):
        LoggingConfig(**overrides)


# --- throughput and MFU --------------------------------------------------------------------------


def test_throughput_times_steps_marks_warmup_and_averages_after_it() -> None:
    meter = Throughput(warmup_steps=1, clock=_fake_clock(100.0, 110.0, 112.0, 113.0, 200.0, 204.0))
    first = meter.update({"loss": 3.0, "tokens": 1000})
    assert first["loss"] == 3.0
    assert (first["step_time_s"], first["tokens_per_s"], first["warmup"]) == (10.0, 100.0, True)
    assert meter.summary() == {}
    second = meter.update({"tokens": 1000})
    assert (second["step_time_s"], second["tokens_per_s"], second["warmup"]) == (2.0, 500.0, False)
    third = meter.update({"tokens": 3000})
    assert (third["step_time_s"], third["tokens_per_s"]) == (1.0, 3000.0)
    meter.reset_timer()  # a checkpoint save between steps 3 and 4 (t = 113 → 200)
    fourth = meter.update({"tokens": 2000})
    assert (fourth["step_time_s"], fourth["tokens_per_s"]) == (4.0, 500.0)
    assert meter.summary() == {"mean_step_time_s": 7.0 / 3, "mean_tokens_per_s": 6000.0 / 7.0}


def test_throughput_on_cpu_reports_peak_rss_and_no_mfu() -> None:
    meter = Throughput(
        flops_per_token=6e6,
        device="cpu",
        world_size=2,
        peak_flops_per_device=1e12,
        clock=_fake_clock(0.0, 1.0),
    )
    metrics = meter.update({"tokens": 10})
    assert metrics.get("mfu") is None and "cuda_memory_gib" not in metrics
    assert 0.01 < metrics["rss_gib"] < 1024
    assert "tokens_per_s" not in Throughput(clock=_fake_clock(0.0, 1.0)).update({"loss": 1.0})


def test_mfu_and_peak_table() -> None:
    assert model_flops_utilization(2000.0, 3e9, peak_flops_per_device=1e13, world_size=4) == 0.15
    names = {
        "NVIDIA H100 80GB HBM3": 989e12,
        "NVIDIA H100 PCIe": 756e12,
        "NVIDIA H100 NVL": 835e12,
        "NVIDIA H200": 989e12,
        "NVIDIA A100-SXM4-80GB": 312e12,
        "NVIDIA A100 80GB PCIe": 312e12,
        "NVIDIA L40S": 362e12,
        "NVIDIA L4": 121e12,
        "NVIDIA B200": 2250e12,
        "NVIDIA GeForce RTX 4090": None,
    }
    assert {name: peak_bf16_flops(name) for name in names} == names


def test_llama_flops_per_token_is_six_n_plus_attention() -> None:
    config = LlamaConfig.debug()
    model = build_llama(config, seed=0)
    matmul_params = sum(
        param.numel() for fqn, param in model.named_parameters() if fqn != "tok_embeddings.weight"
    )
    seq_len = 16
    attention = 12 * config.n_layers * config.dim * seq_len
    assert llama_flops_per_token(config, seq_len) == 6 * matmul_params + attention
    assert llama_flops_per_token(LlamaConfig.llama3_8b(), 8192) == pytest.approx(
        6 * 7.50e9 + 12 * 32 * 4096 * 8192, rel=1e-2
    )  # Llama 3 8B: 8.03e9 parameters, 0.53e9 of them the embedding table
    with pytest.raises(MeshtrainError, match=r"seq_len=0"):
        llama_flops_per_token(config, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_throughput_on_cuda_reports_cuda_memory_and_mfu() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    block = torch.empty(2**28, dtype=torch.uint8, device=device)  # 0.25 GiB
    meter = Throughput(
        flops_per_token=1e9,
        device=device,
        world_size=1,
        peak_flops_per_device=1e15,
        clock=_fake_clock(0.0, 1.0),
    )
    metrics = meter.update({"tokens": 100_000})
    del block
    assert metrics["cuda_memory_gib"] >= 0.25 and "rss_gib" not in metrics
    assert metrics["mfu"] == pytest.approx(0.1)


def _children_named(part: str) -> list[int]:
    """This process's child processes whose command line holds ``part`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and part in command:
            found.append(int(entry.name))
    return found


def test_a_sink_that_fails_is_named_once_and_turned_off_while_the_others_log_on(
    tmp_path: Path, offline_wandb_env: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """wandb's service process killed mid-run (SIGKILL, as an OOM killer or an operator would):
    the next step's ``log`` raised out of the training loop and ended the run at step 4 with no
    checkpoint. Now the wandb sink is named once on stderr and turned off; metrics.jsonl keeps
    every step and closing the run does not wait on the dead service."""
    run_dir = tmp_path / "run"
    config = LoggingConfig(console=False, jsonl=True, wandb="offline", wandb_project="tests")
    sinks = make_sinks(config, run_dir=run_dir, rank=0, total_steps=6, run_name="debug")
    sinks.start(config={}, plan_text=PLAN_TEXT, plan_json=PLAN_JSON)
    sinks.log(1, {"loss": 2.5})
    (service,) = _children_named("wandb")
    os.kill(service, signal.SIGKILL)
    os.waitpid(service, 0)
    for step in range(2, 7):
        sinks.log(step, {"loss": 2.5 - step / 10})
    sinks.close()
    err = capsys.readouterr().err
    assert err.count("meshtrain: the metrics sink WandbSink failed at step") == 1, err
    assert "turned off for the rest of this run" in err and "still logging to: " in err
    assert list(sinks.failed) == ["WandbSink"]
    assert [row["step"] for row in read_jsonl(run_dir / METRICS_FILE)] == [1, 2, 3, 4, 5, 6]


def test_a_sink_raising_in_log_leaves_the_run_and_the_other_sinks_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    class FullDisk:
        def start(self, *, config: Any, plan_text: str, plan_json: str) -> None: ...
        def log(self, step: int, metrics: Any) -> None:
            if step >= 2:
                raise OSError(28, "No space left on device")

        def close(self, *, failed: bool = False) -> None:
            raise AssertionError("a sink turned off is not closed")

    jsonl = JsonlSink(tmp_path / METRICS_FILE)
    sinks = Sinks([FullDisk(), jsonl], total_steps=4)
    for step in range(1, 5):
        sinks.log(step, {"loss": 1.0})
    sinks.close()
    err = capsys.readouterr().err
    assert err == (
        "meshtrain: the metrics sink FullDisk failed at step 2 (OSError: [Errno 28] No space "
        "left on device); it is turned off for the rest of this run, which trains and "
        "checkpoints on (still logging to: JsonlSink)\n"
    )
    assert [row["step"] for row in read_jsonl(tmp_path / METRICS_FILE)] == [1, 2, 3, 4]
