"""Distributed checkpoints: save on every rank, resume under any mesh, export for inference.

A checkpoint is keyed by full-model parameter FQN, not by module or rank: ``model.<fqn>`` for
each parameter and ``optim.<fqn>.<state key>`` for each optimizer state, built from what
``named_parameters()`` yields on this rank (DTensors under FSDP/TP, plain tensors otherwise, a
subset of FQNs under a pipeline). torch.distributed.checkpoint (DCP) writes each rank's shards
and, on load, reshards them into whatever targets the *current* mesh and rules built: dp, tp and
pp may all change between save and load. Nothing is rebuilt from the checkpoint's metadata.

Saves are atomic: ranks write into ``step_<8 digits>.tmp-<id>/``; only after every rank's writes
and DCP's metadata are on disk does rank 0 add ``meshtrain.json`` and rename the directory to
``step_<8 digits>``. Loading reads DCP's pickled metadata with a restricted unpickler (see
:mod:`meshtrain.train.checkpoint.files`); non-tensor state is JSON.

Example (on every rank)::

    checkpointer = Checkpointer(CheckpointConfig("runs/ckpt", interval=100, keep_last=3))
    params = dict(applied.named_parameters())
    for step in range(1, steps + 1):
        ...  # train
        if checkpointer.due(step):
            checkpointer.save(step, params, optimizer, {"step": step, "data": position})
    checkpointer.wait()
    # later, under any mesh:
    extra = load_checkpoint(latest_checkpoint("runs/ckpt"), params, optimizer)
"""

from __future__ import annotations

import json
import logging
import shutil
import uuid
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata

from meshtrain.errors import CheckpointError, describe_os_error
from meshtrain.train.checkpoint.files import (
    METADATA_FILE,
    MODEL_PREFIX,
    TMP_MARKER,
    RestrictedFileSystemReader,
    checkpoint_name,
    checkpoint_step,
    latest_checkpoint,
    list_checkpoints,
    prune,
    publish,
    read_checkpoint_metadata,
    read_state_file,
    remove_stale,
    single_process_dcp,
    write_state_file,
)
from meshtrain.train.checkpoint.integrity import (
    CheckpointStatus,
    digest_files,
    file_problems,
    inspect_checkpoint,
    seal_state,
)
from meshtrain.train.checkpoint.packed import PackedLoadPlanner, PackedSavePlanner, checkpoint_view
from meshtrain.train.checkpoint.state import (
    PreparedOptimizer,
    canonical_params,
    prepare_optimizer,
    state_dict_to_save,
    state_json,
    target_problems,
    unexpected_message,
)

__all__ = [
    "CheckpointConfig",
    "Checkpointer",
    "ResumePoint",
    "find_resume_point",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "verify_checkpoint",
]

_LOG = logging.getLogger(__name__)
# DCP's CheckpointException (one rank's failure, re-raised on every rank) is a BaseException.
_FAILURES = (Exception, CheckpointException)


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often to checkpoint.

    ``interval``: save every ``interval`` steps (0: never by schedule; call ``save`` yourself).
    ``keep_last``: complete checkpoints kept, older ones removed after each save (0: keep all).
    ``async_save``: write in a background thread over a separate gloo group (created when the
    :class:`Checkpointer` is, on every rank); ``save`` returns once the state is copied, and the
    checkpoint is published by the next ``save`` or ``wait``.

    Example:
        >>> CheckpointConfig("runs/ckpt", interval=100).path.name
        'ckpt'
    """

    directory: str | Path
    interval: int = 0
    keep_last: int = 3
    async_save: bool = False

    def __post_init__(self) -> None:
        for name in ("interval", "keep_last"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CheckpointError(
                    f"CheckpointConfig.{name}={value!r} is invalid: use a whole number ≥ 0 "
                    f"(0 means {'never' if name == 'interval' else 'keep all'})."
                )

    @property
    def path(self) -> Path:
        """``directory`` as a path."""
        return Path(self.directory)


@dataclass
class _PendingSave:
    step: int
    scratch: Path
    final: Path
    future: Future[Any]
    state_text: str


class Checkpointer:
    """Saves checkpoints of one run on its schedule; construct it and call every method on every
    rank alike.

    Example:
        >>> import tempfile
        >>> checkpointer = Checkpointer(CheckpointConfig(tempfile.mkdtemp(), interval=10))
        >>> [step for step in range(25) if checkpointer.due(step)]
        [10, 20]
    """

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config
        self.protected: int | None = None
        self._pending: _PendingSave | None = None
        self._async_group: dist.ProcessGroup | None = None
        self._told_sync = False
        if config.async_save and _distributed():
            # Now, while the rendezvous store is surely up: a job whose launcher has died can
            # still save on its way out, and creating a group needs the store.
            self._checkpoint_group()

    def protect(self, step: int | None) -> None:
        """Never let ``keep_last`` prune the checkpoint of ``step`` (the run's last good one,
        :class:`~meshtrain.train.guard.LastGood`); ``None`` lifts the protection."""
        self.protected = step

    def due(self, step: int) -> bool:
        """Whether ``step`` (the number of optimizer steps done) is on the save interval."""
        interval = self.config.interval
        return interval > 0 and step > 0 and step % interval == 0

    def save(
        self,
        step: int,
        params: Mapping[str, Tensor],
        optimizer: torch.optim.Optimizer | None,
        extra: Mapping[str, Any],
        *,
        wait: bool = False,
    ) -> Path:
        """Checkpoint ``params`` (FQN → local tensor), ``optimizer``'s state and the JSON-ready
        ``extra`` (rank 0's is written) as step ``step``; return the checkpoint's path.

        Synchronous: returns once the checkpoint is complete, its files' checksums recorded, and
        visible to every rank. Async (``config.async_save`` with a process group, unless
        ``wait``): returns once this rank's state is copied; a previous async save is finalised
        first. Raises :class:`CheckpointError` on every rank when any rank fails (an unwritable
        directory, a full disk); the previous complete checkpoint stays the latest.
        """
        self._finalise_pending()
        directory = self.config.path
        problems: list[str] = []
        state_dict = state_dict_to_save(params, optimizer, problems)
        described = {fqn: checkpoint_view(tensor) for fqn, tensor in state_dict.items()}
        state_text = state_json(step, _world_size(), optimizer, extra, problems)
        token = uuid.uuid4().hex[:8]
        final = directory / checkpoint_name(step)
        if _rank() == 0 and not problems:
            try:
                directory.mkdir(parents=True, exist_ok=True)
                remove_stale(directory, keep=directory / f"{final.name}.tmp-{token}")
            except OSError as err:
                problems.append(f"cannot write into {str(directory)!r}: {describe_os_error(err)}")
        gathered = _all_gather((problems, token))
        _raise_problems(f"cannot save checkpoint step {step} in {str(directory)!r}", gathered)
        token = gathered[0][1]
        scratch = directory / f"{final.name}.tmp-{token}"
        if self.config.async_save and not _distributed() and not self._told_sync:
            self._told_sync = True
            _LOG.info("async_save needs a process group; saving synchronously in one process")
        if self.config.async_save and _distributed() and not wait:
            group = self._checkpoint_group()
            response = dcp.async_save(
                described,
                storage_writer=FileSystemWriter(scratch),
                process_group=group,
                planner=PackedSavePlanner(),
            )
            upload = response if isinstance(response, Future) else response.upload_completion
            self._pending = _PendingSave(step, scratch, final, upload, state_text)
            return final
        written: Future[Any] = Future()
        try:
            with single_process_dcp():
                metadata = dcp.save(
                    described,
                    storage_writer=FileSystemWriter(scratch),
                    planner=PackedSavePlanner(),
                    no_dist=not _distributed(),
                )
            written.set_result(metadata)
        except _FAILURES as err:  # DCP raises on every rank when any rank failed
            written.set_exception(err)
        self._pending = _PendingSave(step, scratch, final, written, state_text)
        self._finalise_pending()
        return final

    def wait(self) -> None:
        """Finalise a pending async save (publish it, prune); call at the end of training."""
        self._finalise_pending()

    def _checkpoint_group(self) -> dist.ProcessGroup:
        # Background writes must not share a group with training's collectives (gloo matches
        # collectives by order per group); DCP's async save needs a CPU backend anyway.
        if self._async_group is None:
            group = dist.new_group(backend="gloo")
            assert group is not None
            self._async_group = group
        return self._async_group

    def _finalise_pending(self) -> None:
        """Every rank: wait for the write and hash its share of the files; rank 0: record the
        checksums, publish and prune; then agree on the outcome (this collective is also the
        barrier after which every rank sees the new directory)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        problems: list[str] = []
        digests: dict[str, Any] = {}
        try:
            written = pending.future.result()
            digests = digest_files(pending.scratch, _files_to_hash(pending.scratch, written))
        except _FAILURES as err:
            problems.append(f"writing {str(pending.scratch)!r} failed: {_describe(err)}")
        hashed = _all_gather((problems, digests))
        if _rank() == 0:
            failed = any(rank_problems for rank_problems, _ in hashed)
            try:
                if not failed:
                    files = {name: digest for _, share in hashed for name, digest in share.items()}
                    self._publish(pending, files)
            except OSError as err:
                problems.append(
                    f"publishing {str(pending.final)!r} failed: {describe_os_error(err)}"
                )
            if failed or problems:  # every rank's writes are over (DCP told all of them)
                shutil.rmtree(pending.scratch, ignore_errors=True)
        gathered = _all_gather((problems, None))
        if any(rank_problems for rank_problems, _ in gathered):
            latest = latest_checkpoint(pending.final.parent)
            _raise_problems(
                f"checkpoint step {pending.step} was not saved (the latest complete checkpoint "
                f"is still {str(latest) if latest else 'none'})",
                gathered,
            )

    def _publish(self, pending: _PendingSave, files: dict[str, Any]) -> None:
        """Rank 0: the sealed state file (with every file's checksum), the rename, the prune."""
        state = json.loads(pending.state_text)
        state["files"] = dict(sorted(files.items()))
        write_state_file(pending.scratch, seal_state(state))
        publish(pending.scratch, pending.final)
        protected = () if self.protected is None else (self.protected,)
        for removed in prune(pending.final.parent, self.config.keep_last, protected=protected):
            _LOG.info("removed old checkpoint %s (keep_last)", removed)


def _files_to_hash(scratch: Path, written: Any) -> list[str]:
    """This rank's share of a finished save's files: the payload files it wrote (DCP names them
    ``__<rank>_<n>.distcp``), and on rank 0 ``.metadata`` and any payload no rank prefix claims."""
    metadata = written if isinstance(written, Metadata) else read_checkpoint_metadata(scratch)
    payload = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
    rank, world = _rank(), _world_size()
    prefixes = tuple(f"__{other}_" for other in range(world))
    mine = [name for name in payload if name.startswith(f"__{rank}_")]
    if rank == 0:
        mine += [METADATA_FILE, *(name for name in payload if not name.startswith(prefixes))]
    return mine


def load_checkpoint(
    path: str | Path,
    params: Mapping[str, Tensor],
    optimizer: torch.optim.Optimizer | None,
    *,
    verify: bool = True,
    trust_pickle: bool = False,
    allow_unverified: bool = False,
) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``params`` and ``optimizer`` in place; return the
    ``extra`` it was saved with. Call on every rank alike.

    ``params`` maps FQN → this rank's parameter as the *current* plan laid it out; DCP reshards
    the saved shards into it, so the mesh may differ from the one that saved. A fresh
    ``optimizer`` gets its state created first (a step with zero gradients and lr 0), then
    overwritten; its param groups' hyper-parameters are restored from the checkpoint. Before
    any tensor is read, every rank's targets are compared with the checkpoint (missing or
    unexpected FQNs, shapes, dtypes), and every rank raises the same :class:`CheckpointError`.

    ``verify`` (default) first checks every file against the checksums recorded when it was
    saved (the ranks share the reading) and raises a :class:`CheckpointError` naming each bad
    file, or naming a checkpoint saved without checksums unless ``allow_unverified``; pass
    ``False`` for a checkpoint :func:`verify_checkpoint` has just passed.
    ``trust_pickle=True`` reads DCP's pickled metadata with ``pickle.load`` instead of the
    restricted unpickler; pass it only for checkpoints whose origin you trust.

    Example::

        extra = load_checkpoint(latest_checkpoint("runs/ckpt"), params, optimizer)
        step = extra["step"]
    """
    path = Path(path)
    if verify:
        _refuse_damaged(verify_checkpoint(path), allow_unverified)
    problems: list[str] = []
    state: dict[str, Any] | None = None
    metadata: Metadata | None = None
    reader = RestrictedFileSystemReader(path, trust_pickle=trust_pickle)
    try:
        state = read_state_file(path)
        metadata = reader.read_metadata()
    except CheckpointError as err:
        problems.append(err.message)
    named = canonical_params(params, problems)
    targets: dict[str, Tensor] = {}
    prepared: PreparedOptimizer | None = None
    if state is not None and metadata is not None and not problems:
        saved = metadata.state_dict_metadata
        targets = {MODEL_PREFIX + fqn: tensor.detach() for fqn, tensor in named.items()}
        if optimizer is not None and state.get("optimizer") is None:
            problems.append(
                "it was saved without an optimizer: pass optimizer=None to load the model only"
            )
        elif optimizer is not None:
            prepared = prepare_optimizer(optimizer, state["optimizer"], saved, named, problems)
            targets.update(prepared.targets)
        problems += target_problems(targets, saved)
    model_fqns = sorted(key for key in targets if key.startswith(MODEL_PREFIX))
    gathered = _all_gather((problems, model_fqns))
    if metadata is not None and not any(rank_problems for rank_problems, _ in gathered):
        wanted = {fqn for _, fqns in gathered for fqn in fqns}
        unexpected = sorted(
            key
            for key in metadata.state_dict_metadata
            if key.startswith(MODEL_PREFIX) and key not in wanted
        )
        if unexpected:  # the same on every rank: computed from the same gathered lists
            gathered = [([unexpected_message(unexpected)], [])]
    try:
        _raise_problems(f"cannot load checkpoint {str(path)!r}", gathered)
        with single_process_dcp():
            described = {fqn: checkpoint_view(tensor) for fqn, tensor in targets.items()}
            dcp.load(
                described,
                storage_reader=reader,
                planner=PackedLoadPlanner(),
                no_dist=not _distributed(),
            )
    except _FAILURES as err:
        if prepared is not None:
            prepared.undo()
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"loading {str(path)!r} failed: {_describe(err)}") from err
    if prepared is not None:
        prepared.finish()
    assert state is not None
    return dict(state.get("extra", {}))


@dataclass(frozen=True)
class ResumePoint:
    """Where a run resumes: the newest checkpoint that verified (``None``: start afresh) and the
    newer ones passed over on the way (damaged, or saves that never finished), newest first."""

    checkpoint: Path | None
    passed_over: tuple[CheckpointStatus, ...]
    blocking: tuple[CheckpointStatus, ...] = ()

    def describe_passed_over(self) -> list[str]:
        """One line per checkpoint passed over: its directory, its status and why."""
        return [
            f"passed over {status.path}: {status.status} ({'; '.join(status.problems)})"
            for status in self.passed_over
        ]

    def refuse_start_over(self, directory: Path) -> None:
        """Raise a :class:`CheckpointError` when nothing can be resumed but checkpoint folders
        exist (``blocking``: every ``step_N`` folder, whole or not): starting from step 1 would
        bury and then overwrite them. Folders of saves that never finished (``*.tmp-*``) do not
        block: they never were a checkpoint."""
        if self.checkpoint is not None or not self.blocking:
            return
        shown = "\n".join(
            f"  - {status.path.name}: {status.status} ({'; '.join(status.problems)})"
            for status in self.blocking
        )
        raise CheckpointError(
            f"no intact checkpoint to resume from in {str(directory)!r}, but it holds "
            f"{len(self.blocking)} checkpoint folder{'s' if len(self.blocking) != 1 else ''} "
            f"that a fresh start would overwrite:\n{shown}\nRepair or move them away "
            "(`meshtrain checkpoints DIR` shows each), or start afresh on purpose with "
            "--set checkpoint.resume=false."
        )


def find_resume_point(
    directory: str | Path, *, verify: bool = True, allow_unverified: bool = False
) -> ResumePoint:
    """The newest complete checkpoint in ``directory`` whose files match their checksums
    (``verify``; the ranks share the reading), and what was passed over to reach it; one saved
    without checksums counts only when ``allow_unverified``. Call on every rank alike: every
    rank gets the same answer.

    Example::

        point = find_resume_point("runs/debug/checkpoints")
        if point.checkpoint is not None:
            extra = load_checkpoint(point.checkpoint, params, optimizer, verify=False)
    """
    directory = Path(directory)
    complete = list_checkpoints(directory)
    _check_same_listing(directory, [path.name for path in complete])
    newest = checkpoint_step(complete[-1]) if complete else -1
    others = sorted(
        (_inspect_quietly(path) for path in _step_folders(directory) if path not in complete),
        key=lambda status: (status.step or -1, status.path.name),
        reverse=True,
    )
    passed = [status for status in others if (status.step or -1) > newest]
    blocking = [status for status in others if TMP_MARKER not in status.path.name]
    for path in reversed(complete):
        status = verify_checkpoint(path) if verify else inspect_checkpoint(path, content=False)
        if status.loadable_if(allow_unverified):
            return ResumePoint(path, tuple(passed))
        passed.append(status)
        blocking.append(status)
    return ResumePoint(None, tuple(passed), tuple(blocking))


def _step_folders(directory: Path) -> list[Path]:
    """Every ``step_*`` entry of ``directory``, finished or not (none when it is missing)."""
    try:
        return [path for path in directory.iterdir() if path.name.startswith("step_")]
    except FileNotFoundError:
        return []
    except OSError as err:
        raise CheckpointError(
            f"cannot list the checkpoint directory {str(directory)!r}: {describe_os_error(err)}"
        ) from err


def _inspect_quietly(path: Path) -> CheckpointStatus:
    """:func:`inspect_checkpoint` without reading tensor files; a folder that cannot be read
    (permissions, not a directory) is ``damaged`` with the reason."""
    try:
        if not path.is_dir():
            return CheckpointStatus(path, None, "damaged", ("not a directory",), 0)
        return inspect_checkpoint(path, content=False)
    except OSError as err:
        return CheckpointStatus(path, None, "damaged", (describe_os_error(err),), 0)


def _refuse_damaged(status: CheckpointStatus, allow_unverified: bool = False) -> None:
    unverified = status.status == "unverified" and not allow_unverified
    if status.status == "damaged" or unverified:
        raise CheckpointError(
            f"checkpoint {str(status.path)!r} is {status.status}, so nothing was loaded:\n"
            + "\n".join(f"  - {problem}" for problem in status.problems)
            + "\nLoad an earlier one (`meshtrain checkpoints DIR` lists them with their status)."
        )


def _check_same_listing(directory: Path, names: list[str]) -> None:
    """Every rank must see the same checkpoints, or they would load different ones (or wait for
    each other forever): a directory on each node's own disk is refused on every rank."""
    seen = _all_gather(names)
    if any(listing != seen[0] for listing in seen):
        views = "; ".join(
            f"rank {rank}: {', '.join(listing[-3:]) or 'none'}" for rank, listing in enumerate(seen)
        )
        raise CheckpointError(
            f"the ranks see different checkpoints in {str(directory)!r} ({views}; the newest "
            "3 shown). Put checkpoint.dir on a filesystem every rank shares."
        )


def verify_checkpoint(path: str | Path) -> CheckpointStatus:
    """:func:`~meshtrain.train.checkpoint.integrity.inspect_checkpoint` shared by the ranks: each reads a
    share of the files, and every rank gets the same verdict. Call on every rank alike."""
    path = Path(path)
    rank, world = _rank(), _world_size()
    outline = inspect_checkpoint(path, content=False)  # the state file and sizes: cheap
    problems: list[str] = []
    if outline.status == "intact":
        listed = read_state_file(path)["files"]
        problems = file_problems(path, listed, sorted(listed)[rank::world])
    gathered = _all_gather(problems)
    found = [problem for rank_problems in gathered for problem in rank_problems]
    if not found:
        return outline
    return CheckpointStatus(path, outline.step, "damaged", tuple(found), outline.size_bytes)


# ------------------------------------------------------------------ agreement across ranks


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _world_size() -> int:
    return dist.get_world_size() if _distributed() else 1


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _all_gather(value: Any) -> list[Any]:
    if not _distributed():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _raise_problems(header: str, gathered: list[tuple[list[str], Any]]) -> None:
    """Raise one error listing every rank's problems (the same text on every rank), if any."""
    ranks_of: dict[str, list[int]] = {}
    for rank, (problems, _) in enumerate(gathered):
        for problem in problems:
            ranks_of.setdefault(problem, []).append(rank)
    if not ranks_of:
        return
    lines = []
    for problem, ranks in ranks_of.items():
        where = "" if len(ranks) == len(gathered) else f" (rank {', '.join(map(str, ranks))})"
        lines.append(f"  - {problem}{where}")
    raise CheckpointError(f"{header}:\n" + "\n".join(lines))


def _describe(err: BaseException) -> str:
    """One line per failing rank: DCP's CheckpointException carries each rank's exception."""
    if isinstance(err, CheckpointException) and err.failures:
        return "; ".join(
            f"rank {rank}: {_describe(failure)}" for rank, (failure, _) in err.failures.items()
        )
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"
