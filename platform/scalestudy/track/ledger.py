"""The Parquet ledger: one row per trial in the TrialResult schema, the study's source of truth.

Written whole after every trial and before any MLflow call, so a crash or an unreachable tracking
server never loses a finished trial: through track/storage.py, as an atomic rename on a local disk
and one object put on an object store (the results root may be either).
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from scalestudy.metrics import CollectiveStats, TrialResult
from scalestudy.track import storage
from scalestudy.track.storage import Location

LEDGER_FILE = "trials.parquet"
JSON_COLUMNS = ("missing", "extra", "resizes")
COMM_PREFIX = "comm/"


def ledger_path(study: str, root: str | Path = "results") -> Location:
    """A Path under a local root, a URI string under a URI root."""
    return storage.join(root, study, LEDGER_FILE)


def result_to_row(result: TrialResult, **meta: Any) -> dict[str, Any]:
    """Flat row: scalars as columns, per-collective stats as `comm/<kind>/<stat>` columns."""
    row = result.model_dump(mode="json", exclude={"comm", *JSON_COLUMNS})
    for name in JSON_COLUMNS:
        row[name] = json.dumps(getattr(result, name), default=str)
    for kind, stats in result.comm.items():
        for stat, value in stats.model_dump().items():
            row[f"{COMM_PREFIX}{kind}/{stat}"] = value
    # model_dump(mode="json") turns NaN into None; keep NaN so Parquet holds numbers, not nulls.
    for key, value in result.model_dump(exclude={"comm", *JSON_COLUMNS}).items():
        if isinstance(value, float):
            row[key] = value
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


class Ledger:
    def __init__(self, path: str | Path):
        self.path = storage.as_location(path)

    def exists(self) -> bool:
        return storage.exists(self.path)

    def rows(self) -> list[dict[str, Any]]:
        if not self.exists():
            return []
        return pq.read_table(io.BytesIO(storage.read_bytes(self.path))).to_pylist()

    def results(self) -> list[TrialResult]:
        return [row_to_result(r) for r in self.rows()]

    def append(self, result: TrialResult, **meta: Any) -> dict[str, Any]:
        """Add one row (replacing an earlier row of the same trial_id) and rewrite atomically."""
        row = result_to_row(result, recorded_at=time.time(), **meta)
        rows = [r for r in self.rows() if r.get("trial_id") != result.trial_id] + [row]
        self._write(rows)
        return row

    def update(self, trial_id: str, **fields: Any) -> None:
        rows = self.rows()
        for r in rows:
            if r.get("trial_id") == trial_id:
                r.update(fields)
        self._write(rows)

    def _write(self, rows: list[dict[str, Any]]) -> None:
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows), buf)
        storage.write_bytes(self.path, buf.getvalue())
