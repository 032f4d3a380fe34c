"""The Parquet ledger: one row per trial in the TrialResult schema, the study's source of truth.

Under `<results root>/<study>/`:
  ledger/<seq>-<label>-<rand>.rows.parquet   appended rows: one part per measured trial, one per
                                             batch of predictions; a later row of a trial_id
                                             replaces the earlier one (a rerun, a retried trial)
  ledger/<seq>-<label>-<rand>.patch.parquet  fields set later on rows already there (the MLflow
                                             run id once the run is logged)
  trials.parquet                             the merged table, exported at the end of a sweep and
                                             of sync-mlflow: for readers outside scalestudy
                                             (pandas, pq.read_table), and where a read starts
                                             (its metadata names the parts it merged, so only
                                             later parts are read); a ledger written before
                                             parts is this file alone
Parts are written once and never rewritten, so recording N trials writes O(N) bytes (the one-file
ledger was read and rewritten whole twice per trial: O(N^2), and N^2 puts' worth on an object
store). Every part is written whole through track/storage.py (temp file, fsync, rename on a local
disk; one put on an object store) before MLflow is told anything, so a crash loses at most the
part being written. seq is nanoseconds since the epoch, kept increasing within a process, so name
order is write order.

Read back: every part in name order; the columns are the union of all parts' (a part's rows share
the union of their own columns; a row lacking a column, e.g. a world-size-1 trial's `comm/...`,
reads None there); a trial's newest row wins and the patches written after it apply to it.
Migration: a study folder with trials.parquet and no parts holds an older ledger; it is read as is,
and the first write copies it, byte for byte, into a part that sorts first (the file stays, until
an export replaces it with the merged table). With parts, a trials.parquet that does not name the
parts it merged (that older file, or an export from before parts that later parts followed) is
not read: the parts are.
"""

from __future__ import annotations

import io
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterable
from enum import Enum
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from scalestudy.metrics import CollectiveStats, TrialResult
from scalestudy.track import storage
from scalestudy.track.storage import Location

log = logging.getLogger(__name__)

LEDGER_FILE = "trials.parquet"
PARTS_DIR = "ledger"
ROWS_SUFFIX = ".rows.parquet"
PATCH_SUFFIX = ".patch.parquet"
JSON_COLUMNS = ("missing", "extra", "resizes", "uncalibrated")
COMM_PREFIX = "comm/"
# In the export's Parquet metadata: the names of the parts it merged (JSON list).
EXPORTED_PARTS_KEY = b"scalestudy.ledger.parts"


def ledger_path(study: str, root: str | Path = "results") -> Location:
    """The study's ledger: its exported table, in the study folder that holds the parts. A Path
    under a local root, a URI string under a URI root. Ledger() takes it (or the study folder)."""
    return storage.join(root, study, LEDGER_FILE)


def result_to_row(result: TrialResult, **meta: Any) -> dict[str, Any]:
    """Flat row: scalars as columns, per-collective stats as `comm/<kind>/<stat>` columns."""
    # One Python-mode dump (NaN stays NaN: Parquet holds numbers, not nulls); enums as values.
    row = result.model_dump(exclude={"comm", *JSON_COLUMNS})
    for key, value in row.items():
        if isinstance(value, Enum):
            row[key] = value.value
    for name in JSON_COLUMNS:
        row[name] = json.dumps(getattr(result, name), default=str)
    for kind, stats in result.comm.items():
        for stat, value in stats.model_dump().items():
            row[f"{COMM_PREFIX}{kind}/{stat}"] = value
    row.update(meta)
    return row


def row_to_result(row: dict[str, Any]) -> TrialResult:
    fields = {k: v for k, v in row.items() if k in TrialResult.model_fields and v is not None}
    for name in JSON_COLUMNS:
        if isinstance(row.get(name), str):
            fields[name] = json.loads(row[name])
    comm: dict[str, dict[str, float]] = {}
    for key, value in row.items():
        if key.startswith(COMM_PREFIX) and value is not None:
            _, kind, stat = key.split("/", 2)
            comm.setdefault(kind, {})[stat] = value
    fields["comm"] = {k: CollectiveStats(**v) for k, v in comm.items()}
    return TrialResult(**fields)


def rows_table(rows: list[dict[str, Any]]) -> pa.Table:
    """A table of rows with the union of their columns (pa.Table.from_pylist takes the first row's
    keys as the schema and drops every other row's extra columns)."""
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    return pa.table({c: _column([row.get(c) for row in rows]) for c in columns})


def _column(values: list[Any]) -> pa.Array:
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):  # mixed kinds: keep each as its JSON
        return pa.array([None if v is None else json.dumps(v, default=str) for v in values])


def _table(blob: bytes, threads: bool = True) -> pa.Table:
    # ParquetFile.read: no dataset machinery; one thread for a one-row part (half the CPU time)
    return pq.ParquetFile(pa.BufferReader(blob)).read(use_threads=threads)


def table_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


_seq_lock = threading.Lock()
_last_seq = 0


def _next_seq() -> int:
    """Nanoseconds since the epoch, strictly increasing within this process."""
    global _last_seq
    with _seq_lock:
        _last_seq = max(time.time_ns(), _last_seq + 1)
        return _last_seq


def _label(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:64]


class Ledger:
    """A study's ledger. `path`: its ledger_path (a `*.parquet` file in the study folder), the
    study folder, or its ledger/ folder; local or a URI."""

    def __init__(self, path: str | Path):
        folder, name = storage.split(path)
        if name == PARTS_DIR:  # the parts' folder itself
            name = LEDGER_FILE
        elif not name.endswith(".parquet"):  # the study folder
            folder, name = storage.as_location(path), LEDGER_FILE
        self.path: Location = storage.join(folder, name)
        self.export_name = name
        self._study = storage.Folder(folder)
        self._parts = storage.Folder(storage.join(folder, PARTS_DIR))
        self._migrated = False

    # --- reading ------------------------------------------------------------------------
    def part_names(self) -> list[str]:
        return [n for n in self._parts.names() if n.endswith((ROWS_SUFFIX, PATCH_SUFFIX))]

    def exists(self) -> bool:
        return bool(self.part_names()) or self._study.exists(self.export_name)

    def rows(self) -> list[dict[str, Any]]:
        return self._rows(self.part_names())

    def _rows(self, names: list[str]) -> list[dict[str, Any]]:
        """The merged rows of these parts (all of them: the ledger), starting from the export
        where it holds a prefix of them (one file read instead of many)."""
        if not names:  # no parts: a one-file ledger from before them, or nothing
            if not self._study.exists(self.export_name):
                return []
            return _merge([(LEDGER_FILE, _table(self._study.read(self.export_name)))])
        base, rest = self._export_base(names)
        tables = [] if base is None else [(LEDGER_FILE, base)]
        for name, blob in zip(rest, self._parts.read_many(rest)):
            try:
                tables.append((name, _table(blob, threads=False)))
            except (pa.ArrowInvalid, OSError) as err:  # written outside storage.py, cut short
                log.warning("ledger part %s unreadable, skipped: %s", name, err)
        return _merge(tables)

    def _export_base(self, names: list[str]) -> tuple[pa.Table | None, list[str]]:
        """(the export, the parts after it) when the export merged parts that all sort before the
        rest, so folding the rest onto it is folding every part; else (None, every part)."""
        try:
            table = _table(self._study.read(self.export_name))
        except (FileNotFoundError, pa.ArrowInvalid, OSError):
            return None, names
        included = json.loads((table.schema.metadata or {}).get(EXPORTED_PARTS_KEY, b"null"))
        if not included or not set(included) <= set(names):  # older file, or parts removed
            return None, names
        done = set(included)
        rest = [n for n in names if n not in done]
        if rest and rest[0] < max(included):  # a part written late, in between: read them all
            return None, names
        return table.replace_schema_metadata(None), rest

    def results(self) -> list[TrialResult]:
        return [row_to_result(r) for r in self.rows()]

    # --- writing ------------------------------------------------------------------------
    def append(self, result: TrialResult, **meta: Any) -> dict[str, Any]:
        """Add one row as one part (replacing, on read, an earlier row of the same trial_id)."""
        row = result_to_row(result, recorded_at=time.time(), **meta)
        self.append_rows([row])
        return row

    def append_many(self, results: Iterable[TrialResult], **meta: Any) -> list[dict[str, Any]]:
        """Add rows as one part (a batch of predictions)."""
        now = time.time()
        rows = [result_to_row(r, recorded_at=now, **meta) for r in results]
        self.append_rows(rows)
        return rows

    def append_rows(self, rows: list[dict[str, Any]]) -> None:
        """Rows made by result_to_row (with their meta columns), as one part."""
        if rows:
            label = rows[0].get("trial_id") if len(rows) == 1 else f"{len(rows)}rows"
            self._write_part(rows_table(rows), _label(str(label)), ROWS_SUFFIX)

    def update(self, trial_id: str, **fields: Any) -> None:
        self.update_many([trial_id], **fields)

    def update_many(self, trial_ids: Iterable[str], **fields: Any) -> None:
        """Set the same fields on several trials' rows: one small part, nothing rewritten."""
        self.patch([{"trial_id": t, **fields} for t in trial_ids])

    def patch(self, patches: list[dict[str, Any]]) -> None:
        """Set fields on trials' rows, each patch {"trial_id": ..., field: value, ...}: one part."""
        if patches:
            label = patches[0]["trial_id"] if len(patches) == 1 else f"{len(patches)}rows"
            self._write_part(rows_table(patches), _label(f"{label}-set"), PATCH_SUFFIX)

    def export(self) -> Location | None:
        """Write the merged table as trials.parquet, for readers outside scalestudy; once per sweep
        or sync, not per trial. None when there are no parts to export."""
        names = self.part_names()
        if not names:
            return None
        table = rows_table(self._rows(names))
        # Which parts it merged: a later read starts from it and reads only the parts after them.
        table = table.replace_schema_metadata({EXPORTED_PARTS_KEY: json.dumps(names)})
        self._study.write(self.export_name, table_bytes(table))
        return self.path

    def _write_part(self, table: pa.Table, label: str, suffix: str) -> None:
        self._migrate()
        name = f"{_next_seq():020d}-{label}-{uuid.uuid4().hex[:8]}{suffix}"
        self._parts.write(name, table_bytes(table))

    def _migrate(self) -> None:
        """Before the first part: a one-file ledger's rows become the part that sorts first (a
        copy; the file stays). Two writers migrating at once make two identical parts: harmless."""
        if self._migrated:
            return
        if not self.part_names() and self._study.exists(self.export_name):
            data = self._study.read(self.export_name)
            self._parts.write(f"{0:020d}-migrated-{uuid.uuid4().hex[:8]}{ROWS_SUFFIX}", data)
            log.info("ledger %s migrated into %s", self.path, PARTS_DIR)
        self._migrated = True


def _merge(tables: list[tuple[str, pa.Table]]) -> list[dict[str, Any]]:
    """Rows of parts in write order: a trial's newest row, with the patches after it applied; every
    row has every column of every part (None where its part had none)."""
    rows: dict[Any, dict[str, Any]] = {}
    columns: dict[str, None] = {}
    for name, table in tables:
        columns.update(dict.fromkeys(table.column_names))
        records = table.to_pylist()
        if name.endswith(PATCH_SUFFIX):
            for patch in records:
                row = rows.get(patch.get("trial_id"))
                if row is not None:
                    row.update(patch)
            continue
        for record in records:
            rows.pop(record.get("trial_id"), None)  # a replaced row moves to the end
            rows[record.get("trial_id")] = record
    return [{c: row.get(c) for c in columns} for row in rows.values()]
