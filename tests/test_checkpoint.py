"""Checkpoints in one process (no process group): layout and listing, keep-last pruning, atomic
publication, exact save/load round trips, the pickle policy and safetensors export/import (tier 1).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from meshtrain import CheckpointError
from meshtrain.train.checkpoint import (
    CheckpointConfig,
    Checkpointer,
    export_safetensors,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_safetensors,
)
from meshtrain.train.checkpoint.files import (
    _ALLOWED_GLOBALS,
    METADATA_FILE,
    STATE_FILE,
    read_checkpoint_metadata,
)
from meshtrain.train.checkpoint.state import initialise_optimizer_state


class TwoLayers(nn.Module):
    def __init__(self, hidden: int = 8, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.first = nn.Linear(4, hidden)
        self.second = nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def _trained(optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW, **options: Any):
    model = TwoLayers()
    optimizer = optimizer_class(model.parameters(), **({"lr": 1e-2} | options))
    for step in range(2):
        model(torch.randn(3, 4, generator=torch.Generator().manual_seed(step))).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def _fake_checkpoint(root: Path, name: str, *, state: bool = True, metadata: bool = True) -> None:
    (root / name).mkdir(parents=True)
    if state:
        (root / name / STATE_FILE).write_text('{"format": "meshtrain-checkpoint", "version": 1}')
    if metadata:
        (root / name / METADATA_FILE).touch()


# ------------------------------------------------------------------------- config and listing


@pytest.mark.parametrize(
    ("field", "value"),
    [("interval", -1), ("keep_last", -2), ("interval", True), ("keep_last", 1.5)],
)
def test_config_rejects_bad_counts(field: str, value: object) -> None:
    with pytest.raises(CheckpointError, match=f"CheckpointConfig.{field}={value!r} is invalid"):
        CheckpointConfig("ckpt", **{field: value})  # type: ignore[arg-type]


def test_due_follows_the_interval_and_zero_means_never(tmp_path: Path) -> None:
    every_3 = Checkpointer(CheckpointConfig(tmp_path, interval=3))
    assert [step for step in range(10) if every_3.due(step)] == [3, 6, 9]
    never = Checkpointer(CheckpointConfig(tmp_path))
    assert not any(never.due(step) for step in range(10))


def test_listing_keeps_complete_checkpoints_only_oldest_first(tmp_path: Path) -> None:
    _fake_checkpoint(tmp_path, "step_00000020")
    _fake_checkpoint(tmp_path, "step_00000003")
    _fake_checkpoint(tmp_path, "step_00000100000")  # past 10⁸ steps the name just grows
    _fake_checkpoint(tmp_path, "step_00000030.tmp-1a2b3c4d")  # being written or crashed
    _fake_checkpoint(tmp_path, "step_00000040", state=False)  # no meshtrain.json
    _fake_checkpoint(tmp_path, "step_00000050", metadata=False)  # no DCP metadata
    _fake_checkpoint(tmp_path, "notes")
    (tmp_path / "step_00000060").touch()  # a file, not a directory
    names = [path.name for path in list_checkpoints(tmp_path)]
    assert names == ["step_00000003", "step_00000020", "step_00000100000"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000100000"


def test_nothing_to_list_in_an_empty_or_missing_directory(tmp_path: Path) -> None:
    assert list_checkpoints(tmp_path) == []
    assert latest_checkpoint(tmp_path / "missing") is None


@settings(max_examples=8)
@given(
    steps=st.lists(st.integers(1, 60), min_size=1, max_size=5, unique=True),
    keep_last=st.integers(0, 3),
)
def test_keep_last_keeps_the_newest_steps(
    tmp_path_factory: pytest.TempPathFactory, steps: list[int], keep_last: int
) -> None:
    directory = tmp_path_factory.mktemp("keep")
    checkpointer = Checkpointer(CheckpointConfig(directory, keep_last=keep_last))
    for step in steps:
        checkpointer.save(step, {"w": torch.full((2,), float(step))}, None, {"step": step})
    kept = sorted(steps)[-keep_last:] if keep_last else sorted(steps)
    assert [path.name for path in list_checkpoints(directory)] == [f"step_{s:08d}" for s in kept]
    assert sorted(path.name for path in directory.iterdir()) == [f"step_{s:08d}" for s in kept]


def test_a_leftover_from_a_crash_is_never_listed_and_removed_by_the_next_save(
    tmp_path: Path,
) -> None:
    leftover = tmp_path / "step_00000005.tmp-deadbeef"
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"half a shard")
    assert latest_checkpoint(tmp_path) is None
    Checkpointer(CheckpointConfig(tmp_path)).save(6, {"w": torch.ones(2)}, None, {})
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step_00000006"]


def test_saving_a_step_again_replaces_it(tmp_path: Path) -> None:
    checkpointer = Checkpointer(CheckpointConfig(tmp_path))
    checkpointer.save(4, {"w": torch.zeros(2)}, None, {"run": 1})
    path = checkpointer.save(4, {"w": torch.ones(2)}, None, {"run": 2})
    target = {"w": torch.zeros(2)}
    assert load_checkpoint(path, target, None) == {"run": 2}
    assert torch.equal(target["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000004"]


def test_extra_that_json_cannot_hold_is_named(tmp_path: Path) -> None:
    checkpointer = Checkpointer(CheckpointConfig(tmp_path))
    with pytest.raises(CheckpointError, match=r"extra\['state'\]\['rng'\] \(a Tensor\)"):
        checkpointer.save(1, {"w": torch.ones(1)}, None, {"state": {"rng": torch.zeros(2)}})
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- exact round trips


@pytest.mark.parametrize(
    ("optimizer_class", "options"),
    [
        (torch.optim.AdamW, {"weight_decay": 0.1, "betas": (0.8, 0.95)}),
        (torch.optim.Adam, {"weight_decay": 0.1, "amsgrad": True}),
        (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.1}),
    ],
)
def test_round_trip_restores_parameters_optimizer_and_extra_exactly(
    tmp_path: Path, optimizer_class: type[torch.optim.Optimizer], options: dict[str, Any]
) -> None:
    model, optimizer = _trained(optimizer_class, **options)
    extra = {"step": 2, "data": {"epoch": 0, "index": 6}, "rng": "AAEC", "loss": [1.5, 0.25]}
    path = Checkpointer(CheckpointConfig(tmp_path)).save(2, _params(model), optimizer, extra)
    fresh = TwoLayers(seed=1)
    fresh_optimizer = optimizer_class(fresh.parameters(), lr=0.5)
    assert load_checkpoint(path, _params(fresh), fresh_optimizer) == extra
    for (fqn, saved), loaded in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(saved, loaded), fqn
        assert loaded.grad is None
        states = optimizer.state[saved]
        assert states.keys() == fresh_optimizer.state[loaded].keys()
        for key, value in states.items():
            assert torch.equal(value, fresh_optimizer.state[loaded][key]), (fqn, key)
    hyper = {key: value for key, value in optimizer.param_groups[0].items() if key != "params"}
    assert {k: fresh_optimizer.param_groups[0][k] for k in hyper} == hyper


def test_wrapper_names_do_not_change_checkpoint_keys(tmp_path: Path) -> None:
    wrapped = {
        "layers.0._checkpoint_wrapped_module.w": torch.arange(3.0),
        "_orig_mod.b": torch.ones(1),
    }
    path = Checkpointer(CheckpointConfig(tmp_path)).save(1, wrapped, None, {})
    plain = {"layers.0.w": torch.zeros(3), "b": torch.zeros(1)}
    load_checkpoint(path, plain, None)
    assert torch.equal(plain["layers.0.w"], torch.arange(3.0))


class CountingSGD(torch.optim.SGD):
    """Keeps a plain Python number in its per-parameter state."""

    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self.state[param]["updates"] = self.state[param].get("updates", 0) + 1
        return super().step(closure)


def test_number_valued_optimizer_state_round_trips_as_numbers(tmp_path: Path) -> None:
    model, optimizer = _trained(CountingSGD, momentum=0.9)
    path = Checkpointer(CheckpointConfig(tmp_path)).save(2, _params(model), optimizer, {})
    fresh = TwoLayers(seed=1)
    fresh_optimizer = CountingSGD(fresh.parameters(), lr=0.5, momentum=0.9)
    load_checkpoint(path, _params(fresh), fresh_optimizer)
    updates = [fresh_optimizer.state[param]["updates"] for param in fresh.parameters()]
    assert updates == [2, 2, 2, 2] and all(type(count) is int for count in updates)


@pytest.mark.parametrize(
    ("optimizer_class", "options"),
    [
        (torch.optim.AdamW, {"weight_decay": 0.5}),
        (torch.optim.Adam, {"weight_decay": 0.5}),
        (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.5, "nesterov": True}),
    ],
)
def test_creating_optimizer_state_changes_no_parameter(
    optimizer_class: type[torch.optim.Optimizer], options: dict[str, Any]
) -> None:
    model = TwoLayers()
    before = [param.detach().clone() for param in model.parameters()]
    optimizer = optimizer_class(model.parameters(), lr=0.1, **options)
    model.first.weight.grad = torch.ones_like(model.first.weight)
    initialised = initialise_optimizer_state(optimizer)
    assert len(initialised) == 4 and all(optimizer.state[param] for param in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert optimizer.param_groups[0]["lr"] == 0.1
    assert torch.equal(model.first.weight.grad, torch.ones_like(model.first.weight))
    assert model.second.weight.grad is None
    assert initialise_optimizer_state(optimizer) == []  # already initialised: nothing to do


# ------------------------------------------------------------------------------- load errors


def test_missing_unexpected_and_reshaped_parameters_are_named(tmp_path: Path) -> None:
    model, _ = _trained()
    path = Checkpointer(CheckpointConfig(tmp_path)).save(1, _params(model), None, {})
    wider = TwoLayers(hidden=16)
    with pytest.raises(
        CheckpointError,
        match=r"'model\.first\.weight' has global shape 8×4 in the checkpoint but 16×4",
    ):
        load_checkpoint(path, _params(wider), None)
    extra_param = {**_params(TwoLayers()), "third.weight": torch.zeros(2)}
    with pytest.raises(
        CheckpointError, match=r"parameters missing from the checkpoint: 'model\.third\.weight'"
    ):
        load_checkpoint(path, extra_param, None)
    first_only = {"first.weight": torch.zeros(8, 4), "first.bias": torch.zeros(8)}
    with pytest.raises(
        CheckpointError,
        match=r"no rank's model has: 'model\.second\.bias', 'model\.second\.weight'",
    ):
        load_checkpoint(path, first_only, None)
    optimizer = torch.optim.AdamW(TwoLayers().parameters())
    with pytest.raises(CheckpointError, match="saved without an optimizer: pass optimizer=None"):
        load_checkpoint(path, _params(TwoLayers()), optimizer)
    assert not optimizer.state, "a failed load leaves a fresh optimizer fresh"


def test_another_optimizer_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    model, optimizer = _trained(torch.optim.SGD, momentum=0.9)
    path = Checkpointer(CheckpointConfig(tmp_path)).save(1, _params(model), optimizer, {})
    fresh = TwoLayers()
    adam = torch.optim.Adam(fresh.parameters(), lr=0.5)
    hyper = {key: value for key, value in adam.param_groups[0].items() if key != "params"}
    with pytest.raises(CheckpointError, match="saved with a SGD optimizer, not Adam"):
        load_checkpoint(path, _params(fresh), adam)
    assert not adam.state
    assert {key: value for key, value in adam.param_groups[0].items() if key != "params"} == hyper


def test_optimizer_state_the_optimizer_would_drop_is_named(tmp_path: Path) -> None:
    model, optimizer = _trained(torch.optim.SGD, momentum=0.9)
    optimizer.state[model.first.bias]["ema"] = torch.ones(8)  # kept by a subclass, say
    path = Checkpointer(CheckpointConfig(tmp_path)).save(1, _params(model), optimizer, {})
    fresh = TwoLayers()
    sgd = torch.optim.SGD(fresh.parameters(), lr=0.5)
    with pytest.raises(CheckpointError, match=r"optimizer state 'ema' for 'first\.bias'"):
        load_checkpoint(path, _params(fresh), sgd)
    assert not sgd.state
    assert sgd.param_groups[0]["momentum"] == 0  # the saved 0.9 was taken back


def test_a_directory_of_checkpoints_is_not_a_checkpoint(tmp_path: Path) -> None:
    Checkpointer(CheckpointConfig(tmp_path)).save(1, {"w": torch.ones(1)}, None, {})
    with pytest.raises(CheckpointError, match=r"pass latest_checkpoint\(path\) instead"):
        load_checkpoint(tmp_path, {"w": torch.ones(1)}, None)


# ------------------------------------------------------------------------------ pickle policy


class _Recorder(pickle.Unpickler):
    def __init__(self, handle: Any) -> None:
        super().__init__(handle)
        self.asked: set[tuple[str, str]] = set()

    def find_class(self, module: str, name: str) -> Any:
        self.asked.add((module, name))
        return super().find_class(module, name)


def test_real_metadata_needs_only_admitted_classes(tmp_path: Path) -> None:
    model, optimizer = _trained()
    params = {**_params(model), "half": torch.ones(3, dtype=torch.bfloat16), "ids": torch.arange(4)}
    path = Checkpointer(CheckpointConfig(tmp_path)).save(1, params, optimizer, {})
    with open(path / METADATA_FILE, "rb") as handle:
        recorder = _Recorder(handle)
        recorder.load()
    dtypes = {("torch", "float32"), ("torch", "bfloat16"), ("torch", "int64")}
    assert recorder.asked - dtypes <= _ALLOWED_GLOBALS
    metadata = read_checkpoint_metadata(path)
    assert tuple(metadata.state_dict_metadata["model.first.weight"].size) == (8, 4)


class _RunsAShell:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _plant_malicious_metadata(tmp_path: Path) -> tuple[Path, Path]:
    model, _ = _trained()
    path = Checkpointer(CheckpointConfig(tmp_path / "ckpt")).save(1, _params(model), None, {})
    marker = tmp_path / "pwned"
    (path / METADATA_FILE).write_bytes(pickle.dumps(_RunsAShell(marker)))
    return path, marker


def test_a_malicious_metadata_pickle_is_refused_and_not_run(tmp_path: Path) -> None:
    path, marker = _plant_malicious_metadata(tmp_path)
    with pytest.raises(CheckpointError, match=r"(?s)is damaged.*\.metadata: .*bytes, expected"):
        load_checkpoint(path, _params(TwoLayers()), None)  # its checksum no longer matches
    # Checksums find damage, not a forger who rewrites meshtrain.json too: the unpickler holds.
    with pytest.raises(
        CheckpointError, match=r"asks to unpickle '(posix|os)\.system'.*trust_pickle=True"
    ):
        load_checkpoint(path, _params(TwoLayers()), None, verify=False)
    with pytest.raises(CheckpointError, match="trust_pickle=True"):
        export_safetensors(path, tmp_path / "model.safetensors")
    assert not marker.exists()
    assert not (tmp_path / "model.safetensors").exists()


def test_trust_pickle_unpickles_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path, marker = _plant_malicious_metadata(tmp_path)
    with caplog.at_level(logging.WARNING), pytest.raises(CheckpointError, match="not DCP"):
        load_checkpoint(path, _params(TwoLayers()), None, verify=False, trust_pickle=True)
    assert marker.exists(), "trust_pickle=True is the caller's choice to run the pickle"
    assert "trust_pickle=True" in caplog.text


def test_metadata_pointing_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    model, _ = _trained()
    path = Checkpointer(CheckpointConfig(tmp_path)).save(1, _params(model), None, {})
    metadata = read_checkpoint_metadata(path)
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (path / METADATA_FILE).write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        load_checkpoint(path, _params(TwoLayers()), None, verify=False)


def test_a_damaged_state_file_is_reported(tmp_path: Path) -> None:
    path = Checkpointer(CheckpointConfig(tmp_path)).save(1, {"w": torch.ones(1)}, None, {})
    (path / STATE_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="damaged"):
        load_checkpoint(path, {"w": torch.ones(1)}, None)
    (path / STATE_FILE).write_text(json.dumps({"format": "other"}))
    with pytest.raises(CheckpointError, match="not a meshtrain checkpoint state file"):
        load_checkpoint(path, {"w": torch.ones(1)}, None)
    (path / STATE_FILE).write_text(json.dumps({"format": "meshtrain-checkpoint", "version": 9}))
    with pytest.raises(CheckpointError, match="format version 9; this meshtrain reads versions"):
        load_checkpoint(path, {"w": torch.ones(1)}, None)


# -------------------------------------------------------------------------------- safetensors


def test_safetensors_export_and_load_round_trip(tmp_path: Path) -> None:
    model, optimizer = _trained()
    path = Checkpointer(CheckpointConfig(tmp_path / "ckpt")).save(7, _params(model), optimizer, {})
    exported = export_safetensors(path, tmp_path / "out" / "model.safetensors")
    with safe_open(str(exported), framework="pt") as handle:
        assert sorted(handle.keys()) == sorted(_params(model))  # model tensors only
        header = handle.metadata()
    assert header["format"] == "pt" and header["step"] == "7"
    assert header["source"] == str(path.resolve())
    fresh = TwoLayers(seed=3)
    load_safetensors(exported, fresh)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    assert [p.name for p in exported.parent.iterdir()] == ["model.safetensors"]


def test_safetensors_export_casts_floating_tensors(tmp_path: Path) -> None:
    params = {"w": torch.randn(3, 2), "ids": torch.arange(3)}
    path = Checkpointer(CheckpointConfig(tmp_path)).save(1, params, None, {})
    exported = export_safetensors(path, tmp_path / "bf16.safetensors", dtype=torch.bfloat16)
    with safe_open(str(exported), framework="pt") as handle:
        assert handle.get_tensor("w").dtype == torch.bfloat16
        assert torch.equal(handle.get_tensor("w"), params["w"].bfloat16())
        assert handle.get_tensor("ids").dtype == torch.int64


def test_safetensors_mismatches_are_named(tmp_path: Path) -> None:
    file = tmp_path / "odd.safetensors"
    save_file({"first.weight": torch.zeros(5, 4), "extra": torch.zeros(1)}, str(file))
    with pytest.raises(CheckpointError, match=r"odd\.safetensors") as caught:
        load_safetensors(file, TwoLayers())
    message = str(caught.value)
    assert f"'first.weight' is 5×4 in {file} but 'first.weight' is 8×4 in the model" in message
    assert (
        "3 tensor(s) the model needs are not in the checkpoint "
        f"({file}): 'first.bias', 'second.bias', 'second.weight'"
    ) in message
    assert "1 tensor(s) in the checkpoint that the model lacks: 'extra'" in message
    partial = {"first.weight": torch.ones(8, 4)}
    save_file(partial, str(file))
    model = TwoLayers()
    load_safetensors(file, model, strict=False)
    assert torch.equal(model.first.weight, partial["first.weight"])


def test_safetensors_load_needs_a_full_materialised_model(tmp_path: Path) -> None:
    file = tmp_path / "w.safetensors"
    save_file({"weight": torch.zeros(2, 3), "bias": torch.zeros(2)}, str(file))
    with torch.device("meta"):
        meta = nn.Linear(3, 2)
    with pytest.raises(CheckpointError, match="meta device"):
        load_safetensors(file, meta)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_safetensors(tmp_path / "nope.safetensors", nn.Linear(3, 2))
