"""Prompt files: the files a `prompts_path` names, and their rows as plain Python values.

A `prompts_path` is a file, a folder written by datasets' `save_to_disk`, a glob of them (expanded in
sorted order), or a list of any of these; the files are read in that order and concatenated. A row's
identity (`RawRow.index`) is its position in the concatenation: every file before it counts all the
positions it spans (a JSONL file its lines, blank ones included; the others their rows), so a row keeps
its index while the files before it are unchanged, and a single JSONL file's rows are its line numbers.

One reader per format (`FORMATS`, by suffix; a folder is a saved dataset):
- `.jsonl`: one JSON object per line, `.json`: one JSON list of objects. Python's json reads them: each
  value as written, a missing key missing (a columnar reader would infer one type per column, fill
  absent keys with null and fail on mixed types without naming the row);
- `.parquet`: pyarrow; a folder: `datasets.load_from_disk` (one split: a DatasetDict names its splits);
- `.csv`: Python's csv, a header line then one row per record; every value is a string (a chat-messages
  column is then JSON text, read as messages by `cluster.prompts.chat.json_messages`), and a row whose
  field count differs from the header's is an error naming it.
Values come out as plain Python (`to_pylist`: str, int, float, bool, None, lists and dicts), never
numpy scalars. Nothing is downloaded.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.config.schema import ConfigError

# (position, row object) of each row of a file, and how many positions the file spans
Read = Callable[[Path], tuple[list[tuple[int, Any]], int]]


@dataclass(frozen=True)
class RawRow:
    index: int  # position in the concatenated files: the prompt's identity (exactly-once, resume)
    where: str  # for messages: "file:LINE" (JSONL, from 1) or "file row N" (from 0, as dataset[N])
    columns: dict[str, Any]


def _read_jsonl(path: Path) -> tuple[list[tuple[int, Any]], int]:
    lines = path.read_text(encoding="utf-8").splitlines()
    rows = []
    for lineno, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append((lineno, json.loads(line)))
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}:{lineno + 1}: not valid JSON ({err.msg})") from None
    return rows, len(lines)


def _read_json(path: Path) -> tuple[list[tuple[int, Any]], int]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err.msg}, line {err.lineno})") from None
    if not isinstance(data, list):
        raise ConfigError(
            f"{path}: a .json prompts file holds one list of objects, got a {type(data).__name__} "
            "(one object per line is a .jsonl file)"
        )
    return list(enumerate(data)), len(data)


def _read_parquet(path: Path) -> tuple[list[tuple[int, Any]], int]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as err:
        raise ConfigError(f"{path}: not a readable parquet file ({err})") from None
    return list(enumerate(rows)), len(rows)


def _read_saved_dataset(path: Path) -> tuple[list[tuple[int, Any]], int]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as err:
        raise ConfigError(
            f"{path}: a folder, but not one written by datasets' save_to_disk ({err})"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        raise ConfigError(
            f"{path}: a DatasetDict with splits {', '.join(ds)}: name one split's folder, e.g. {path / next(iter(ds))}"
        )
    rows = ds.with_format(None).to_list()  # python formatting: pyarrow's to_pylist, no numpy scalars
    return list(enumerate(rows)), len(rows)


def _read_csv(path: Path) -> tuple[list[tuple[int, Any]], int]:
    import csv

    with path.open(encoding="utf-8", newline="") as f:
        records = list(csv.reader(f))
    if not records:
        return [], 0
    header, rows = records[0], []
    for position, record in enumerate(records[1:]):
        if len(record) != len(header):
            raise ConfigError(
                f"{path} row {position}: {len(record)} fields, but the header line has {len(header)} "
                f"({', '.join(header)}): quote fields holding commas or newlines"
            )
        rows.append((position, dict(zip(header, record, strict=True))))
    return rows, len(rows)


@dataclass(frozen=True)
class FileFormat:
    name: str
    read: Read
    by_line: bool  # positions are lines (shown from 1 as file:LINE) rather than rows (file row N)

    def where(self, path: Path, position: int) -> str:
        return f"{path}:{position + 1}" if self.by_line else f"{path} row {position}"


FORMATS: dict[str, FileFormat] = {
    ".jsonl": FileFormat("jsonl", _read_jsonl, by_line=True),
    ".json": FileFormat("json", _read_json, by_line=False),
    ".parquet": FileFormat("parquet", _read_parquet, by_line=False),
    ".csv": FileFormat("csv", _read_csv, by_line=False),
}
SAVED_DATASET = FileFormat("datasets folder", _read_saved_dataset, by_line=False)
ALLOWED = f"{', '.join(FORMATS)} or a folder written by datasets' save_to_disk"


def file_format(path: Path, option: str) -> FileFormat:
    if path.is_dir():
        return SAVED_DATASET
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(
            f"{option}: {path}: unknown format {path.suffix or '(no suffix)'!r}; allowed: {ALLOWED}"
        )
    return fmt


def prompt_files(spec: str | list[str], option: str) -> list[Path]:
    """The files (and saved-dataset folders) `spec` names, in reading order; each exists and has a
    known format. A glob matching nothing, a missing file or an unknown suffix is a ConfigError."""
    paths: list[Path] = []
    for entry in [spec] if isinstance(spec, str) else spec:
        pattern = str(Path(entry).expanduser())
        if glob.has_magic(pattern):
            matches = sorted(glob.glob(pattern))
            if not matches:
                raise ConfigError(f"{option}: no file matches {entry}")
            paths += [Path(m) for m in matches]
        elif Path(pattern).exists():
            paths.append(Path(pattern))
        else:
            raise ConfigError(f"{option}: file not found: {entry}")
    for path in paths:
        file_format(path, option)
    return paths


def read_rows(spec: str | list[str], option: str) -> list[RawRow]:
    """Every row of the files `spec` names, concatenated in order; each row an object (a dict)."""
    rows: list[RawRow] = []
    offset = 0
    for path in prompt_files(spec, option):
        fmt = file_format(path, option)
        found, span = fmt.read(path)
        for position, obj in found:
            where = fmt.where(path, position)
            if not isinstance(obj, dict):
                raise ConfigError(f"{where}: a row must be an object of columns, got a {type(obj).__name__}")
            rows.append(RawRow(offset + position, where, obj))
        offset += span
    return rows
