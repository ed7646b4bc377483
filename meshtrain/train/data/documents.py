"""Documents from local files: JSON Lines, plain text, Parquet and saved Hugging Face datasets.

Why: a recipe names its data (``[data] source`` and ``path``) and the field to read; this module
turns that into a stream of :class:`Document` objects, each knowing where it came from, so a bad
file is one line naming the file and line (or row) and the fix, before any rank starts. Nothing
is downloaded: ``hf-dataset`` reads a directory written by ``datasets.save_to_disk``.

- ``jsonl``: one JSON object per line; the document is ``obj[field]`` (``format = "text"``) or
  the pair ``obj[prompt_field]``, ``obj[response_field]`` (``format = "instruction"``).
- ``text``: each file is one document (``path`` a file or a directory of ``*.txt`` files).
- ``parquet``: a column of a Parquet file, or of every ``*.parquet`` file in a directory
  (needs ``pyarrow``: ``pip install 'meshtrain[data]'``).
- ``hf-dataset``: a column of a dataset saved with ``save_to_disk`` (needs ``datasets``).

Example:
    >>> import json, pathlib, tempfile
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     path = pathlib.Path(tmp, "d.jsonl")
    ...     _ = path.write_text(json.dumps({"text": "hi"}) + "\\n" + json.dumps({"text": "yo"}))
    ...     [doc.text for doc in read_documents(DocumentSource("jsonl", str(path)))]
    ['hi', 'yo']
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from meshtrain.train.data.corpus import DataError

__all__ = ["FILE_SOURCES", "Document", "DocumentSource", "read_documents", "source_files"]

#: The ``[data] source`` values read from the user's files.
FILE_SOURCES = ("jsonl", "text", "parquet", "hf-dataset")
DocumentFormat = Literal["text", "instruction"]
_SUFFIXES = {"jsonl": (".jsonl", ".json"), "text": (".txt", ".md"), "parquet": (".parquet",)}


@dataclass(frozen=True)
class DocumentSource:
    """Where documents come from and which fields hold them.

    ``kind`` is one of :data:`FILE_SOURCES`; ``format = "instruction"`` reads a prompt and a
    response (the prompt is masked from the loss when tokenised).
    """

    kind: str
    path: str
    text_field: str = "text"
    format: DocumentFormat = "text"
    prompt_field: str = "prompt"
    response_field: str = "response"

    def fields(self) -> tuple[str, ...]:
        """The fields each record must have."""
        if self.format == "instruction":
            return (self.prompt_field, self.response_field)
        return (self.text_field,)


@dataclass(frozen=True)
class Document:
    """One document: its ``text`` (the response, for instructions), an optional ``prompt`` and
    ``where`` it came from (``file:line`` or ``file:row N``)."""

    text: str
    where: str
    prompt: str = ""


def source_files(source: DocumentSource) -> list[Path]:
    """The files ``source`` reads, sorted; a :class:`DataError` when there are none.

    Example:
        >>> source_files(DocumentSource("jsonl", "/no/such/file.jsonl"))
        Traceback (most recent call last):
        ...
        meshtrain.errors.DataError: data.path = '/no/such/file.jsonl' does not exist. Point data.path at the jsonl data (a file or directory).
    """
    path = Path(source.path)
    if not path.exists():
        what = "save_to_disk directory" if source.kind == "hf-dataset" else "file or directory"
        raise DataError(
            f"data.path = {source.path!r} does not exist. Point data.path at the {source.kind} "
            f"data (a {what})."
        )
    if source.kind == "hf-dataset":
        return [path]
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _SUFFIXES[source.kind])
    if not files:
        suffixes = ", ".join(_SUFFIXES[source.kind])
        raise DataError(
            f"data.path = {source.path!r} is a directory with no {suffixes} files. Point it at "
            f"the {source.kind} data, or set data.source to the files' format."
        )
    return files


def read_documents(source: DocumentSource) -> Iterator[Document]:
    """Every document of ``source``, in file order (see the module docstring)."""
    readers = {"jsonl": _jsonl, "text": _text, "parquet": _parquet, "hf-dataset": _hf_dataset}
    if source.kind not in readers:
        raise DataError(f"data.source = {source.kind!r} is not one of {', '.join(FILE_SOURCES)}.")
    for path in source_files(source):
        count = 0
        for document in readers[source.kind](source, path):
            count += 1
            yield document
        if count == 0:
            raise DataError(f"{path}: holds no documents (an empty file). Remove it or fill it.")


def _record(source: DocumentSource, record: Any, where: str) -> Document:
    """The document a record (a JSON object, a table row) holds, checked."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}.")
    values = []
    for name in source.fields():
        if name not in record:
            have = ", ".join(sorted(map(str, record))) or "none"
            raise DataError(
                f"{where}: no field {name!r} (fields: {have}). Set data.{_key(source, name)} "
                "to the field that holds the text."
            )
        value = record[name]
        if not isinstance(value, str):
            raise DataError(
                f"{where}: field {name!r} is {type(value).__name__}, not text. Store text there."
            )
        values.append(value)
    if source.format == "instruction":
        return Document(values[1], where, prompt=values[0])
    return Document(values[0], where)


def _key(source: DocumentSource, name: str) -> str:
    if source.format == "text":
        return "text_field"
    return "prompt_field" if name == source.prompt_field else "response_field"


def _jsonl(source: DocumentSource, path: Path) -> Iterator[Document]:
    offset = 0  # of the line in the file, in bytes
    with open(path, "rb") as stream:
        for number, raw in enumerate(stream, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise _not_utf8(path, number, offset + err.start, raw[err.start]) from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                raise DataError(
                    f"{path}:{number}: not a JSON object ({err}). Fix or remove the line."
                ) from None
            yield _record(source, record, f"{path}:{number}")


def _not_utf8(path: Path, line: int, offset: int, byte: int) -> DataError:
    """The first byte that is not UTF-8, by line and by its offset in the file."""
    return DataError(
        f"{path}:{line}: not UTF-8 text (byte 0x{byte:02x} at offset {offset:,} of the file). "
        "Re-encode the file as UTF-8, or fix or remove the line."
    )


def _text(source: DocumentSource, path: Path) -> Iterator[Document]:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise _not_utf8(path, line, err.start, data[err.start]) from None
    if source.format == "instruction":
        raise DataError(
            f"{path}: data.format = 'instruction' needs prompt and response fields; plain text "
            "has none. Use data.source = 'jsonl', 'parquet' or 'hf-dataset'."
        )
    if text.strip():
        yield Document(text, str(path))


def _columns(
    source: DocumentSource, where: Path, names: list[str], rows: Iterator[dict[str, Any]]
) -> Iterator[Document]:
    missing = [name for name in source.fields() if name not in names]
    if missing:
        raise DataError(
            f"{where}: no column {missing[0]!r} (columns: {', '.join(names) or 'none'}). Set "
            f"data.{_key(source, missing[0])} to the column that holds the text."
        )
    for number, row in enumerate(rows):
        yield _record(source, row, f"{where}:row {number}")


def _parquet(source: DocumentSource, path: Path) -> Iterator[Document]:
    parquet = _optional("pyarrow.parquet", "pyarrow", "Parquet files", path)
    try:
        table = parquet.ParquetFile(path)
    except Exception as err:
        raise DataError(f"{path}: not a readable Parquet file ({err}).") from None
    names = list(table.schema_arrow.names)
    wanted = [name for name in source.fields() if name in names]
    rows = (row for batch in table.iter_batches(columns=wanted) for row in batch.to_pylist())
    yield from _columns(source, path, names, rows)


def _hf_dataset(source: DocumentSource, path: Path) -> Iterator[Document]:
    datasets = _optional("datasets", "datasets", "saved Hugging Face datasets", path)
    try:
        dataset = datasets.load_from_disk(str(path))
    except Exception as err:
        raise DataError(
            f"{path}: not a dataset saved by datasets.save_to_disk ({err}). Save it with "
            "dataset.save_to_disk(path), or use another data.source."
        ) from None
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise DataError(
                f"{path}: a DatasetDict without a 'train' split (splits: {', '.join(dataset)}). "
                "Save the split to train on."
            )
        dataset = dataset["train"]
    yield from _columns(source, path, list(dataset.column_names), iter(dataset))


def _optional(module: str, package: str, what: str, path: Path) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(
            f"{path}: reading {what} needs the optional {package!r} package: pip install "
            f"'meshtrain[data]' (or pip install {package})."
        ) from None
