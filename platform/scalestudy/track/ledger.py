"""The Parquet ledger: one row per trial in the TrialResult schema, the study's source of truth.

Written atomically (temp file + rename) after every trial and before any MLflow call, so a crash
or an unreachable tracking server never loses a finished trial.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from scalestudy.metrics import CollectiveStats, TrialResult

LEDGER_FILE = "trials.parquet"
JSON_COLUMNS = ("missing", "extra", "resizes")
COMM_PREFIX = "comm/"


def ledger_path(study: str, root: str | Path = "results") -> Path:
    return Path(root) / study / LEDGER_FILE


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
        self.path = Path(path)

    def rows(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        # One read of the file's bytes: pyarrow opens a path more than once (footer, then pages),
        # so a reader racing the writer's rename could take its footer from one version and its
        # pages from the next ('Page was smaller than expected'; test_sweep's reader while the
        # driver records the next trial).
        return pq.read_table(pa.BufferReader(self.path.read_bytes())).to_pylist()

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
        self.path.parent.mkdir(parents=True, exist_ok=True)
        table = pa.Table.from_pylist(rows)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".trials-", suffix=".parquet")
        os.close(fd)
        try:
            pq.write_table(table, tmp)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
