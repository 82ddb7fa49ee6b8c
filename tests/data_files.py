"""Prompt files of every format the data loader reads, written from the same rows (for tests)."""

from __future__ import annotations

import json
from pathlib import Path


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_json(path: Path, rows: list) -> Path:
    path.write_text(json.dumps(rows))
    return path


def write_parquet(path: Path, rows: list) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_dataset(path: Path, rows: list) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def write_csv(path: Path, rows: list[dict]) -> Path:
    """A CSV file with a header line; every value must already be a string (CSV holds only text)."""
    import csv

    with path.open("w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            assert all(isinstance(v, str) for v in row.values()), row
            writer.writerow(row)
    return path


WRITERS = {"jsonl": write_jsonl, "json": write_json, "parquet": write_parquet, "dataset": write_dataset}


def write(tmp_path: Path, fmt: str, rows: list, name: str = "prompts") -> Path:
    return WRITERS[fmt](tmp_path / (name if fmt == "dataset" else f"{name}.{fmt}"), rows)
