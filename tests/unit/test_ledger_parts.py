"""The ledger as appended parts (track/ledger.py): every column of every trial comes back, a trial's
newest row wins, patches apply, a write cut short loses nothing recorded, recording N trials
writes O(N) bytes, and a one-file ledger from before parts is read and migrated once. Each case
runs on a local folder, a filesystem URI (fsspec's in-memory store) and S3 (a moto server)."""

from __future__ import annotations

import itertools
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from scalestudy.metrics import CollectiveStats, Status, TrialResult
from scalestudy.track import storage
from scalestudy.track.ledger import (
    LEDGER_FILE, PARTS_DIR, Ledger, ledger_path, result_to_row, rows_table, table_bytes,
)
from tests.conftest import trial
from tests.s3_server import s3_server

_roots = itertools.count()


@pytest.fixture(params=["local", "memory", "s3"])
def root(request, tmp_path):
    if request.param == "local":
        yield tmp_path / "results"
    elif request.param == "memory":
        yield f"memory://ledger-parts-{next(_roots)}/results"
    else:
        with s3_server("ledger") as _:
            yield f"s3://ledger/results-{next(_roots)}"  # moto keeps objects across servers


def _result(world: int, **kw) -> TrialResult:
    cfg = trial([f"world_size={world}", "zero_stage=0", "micro_batch=1"])
    return TrialResult.from_config(cfg, Status.completed, step_time_s=0.5, **kw)


def _world2() -> TrialResult:
    """A world-size-2 trial with collectives (a world-size-1 trial has none)."""
    comm = {"all_reduce": CollectiveStats(count=4, bytes=1e6, time_s=0.01, bus_bytes=1e6),
            "broadcast": CollectiveStats(count=1, bytes=10.0, time_s=0.001, bus_bytes=10.0)}
    return _result(2, comm=comm)


def _comm_columns(row: dict) -> dict:
    return {k: v for k, v in row.items() if k.startswith("comm/")}


def test_world_1_then_world_2_keeps_the_world_2_comm_columns(root):
    ledger = Ledger(ledger_path("s", root))
    one, two = _result(1), _world2()
    ledger.append(one)
    ledger.append(two)
    back = {r["world_size"]: r for r in Ledger(ledger_path("s", root)).rows()}
    expected = _comm_columns(result_to_row(two))
    assert expected and _comm_columns(back[2]) == pytest.approx(expected, nan_ok=True)
    assert back[2]["comm/all_reduce/count"] == 4
    assert set(_comm_columns(back[1])) == set(_comm_columns(back[2]))  # union of columns
    assert all(v is None for v in _comm_columns(back[1]).values())
    results = {r.world_size: r for r in Ledger(ledger_path("s", root)).results()}
    assert results[2].model_dump_json() == two.model_dump_json() and results[1].comm == {}
    # The export (for pandas) has the union of the columns too.
    ledger.export()
    if isinstance(root, os.PathLike):
        table = pq.read_table(ledger.path)
        assert "comm/all_reduce/count" in table.column_names
        assert table.to_pylist()[1]["comm/broadcast/count"] == 1


def test_a_batch_part_keeps_every_rows_columns():
    rows = [result_to_row(_result(1)), result_to_row(_world2())]
    table = rows_table(rows)
    assert table.num_rows == 2 and "comm/all_reduce/time_s" in table.column_names
    assert table.column("comm/all_reduce/time_s").to_pylist() == [None, 0.01]


def test_newest_row_wins_and_patches_apply_after_it(root):
    ledger = Ledger(ledger_path("s", root))
    first, other = _result(1), _world2()
    ledger.append(first, mlflow_run_id=None)
    ledger.append(other, mlflow_run_id=None)
    ledger.update(first.trial_id, mlflow_run_id="run-1")
    (row,) = [r for r in ledger.rows() if r["trial_id"] == first.trial_id]
    assert row["mlflow_run_id"] == "run-1" and row["step_time_s"] == 0.5
    # A rerun of the trial replaces its row (and the older patch with it), moving it last.
    ledger.append(_result(1, tokens_per_s=123.0), mlflow_run_id=None)
    rows = ledger.rows()
    assert [r["trial_id"] for r in rows] == [other.trial_id, first.trial_id]
    assert rows[-1]["tokens_per_s"] == 123.0 and rows[-1]["mlflow_run_id"] is None
    ledger.update_many([first.trial_id, other.trial_id], mlflow_run_id="parent")
    assert {r["mlflow_run_id"] for r in ledger.rows()} == {"parent"}
    ledger.update("no-such-trial", mlflow_run_id="x")  # a patch of no row adds none
    assert len(ledger.rows()) == 2


def test_a_write_cut_short_loses_nothing_recorded(tmp_path, monkeypatch, caplog):
    ledger = Ledger(ledger_path("s", tmp_path))
    kept = _result(1)
    ledger.append(kept)

    def crash(src, dst):
        raise OSError("killed mid-write")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="killed"):
        ledger.append(_world2())
    monkeypatch.undo()
    parts = tmp_path / "s" / PARTS_DIR
    assert not [p for p in parts.iterdir() if p.name.startswith(".")]  # no temp file left
    assert [r["trial_id"] for r in ledger.rows()] == [kept.trial_id]
    # A part cut short by something else (a copy, a filesystem without atomic writes) is skipped
    # with a warning; every other part still reads.
    (parts / "99999999999999999999-torn-0.rows.parquet").write_bytes(b"PAR1\x00\x01")
    assert [r["trial_id"] for r in ledger.rows()] == [kept.trial_id]
    assert "unreadable" in caplog.text


def test_recording_n_trials_writes_o_of_n_bytes(tmp_path, monkeypatch):
    """The one-file ledger rewrote every row on every append: the 40th trial wrote 40 rows."""
    sizes: list[int] = []
    write = storage.Folder.write

    def counting(self, name, data):
        sizes.append(len(data))
        write(self, name, data)

    monkeypatch.setattr(storage.Folder, "write", counting)
    ledger = Ledger(ledger_path("s", tmp_path))
    base = _result(1)
    for i in range(40):
        result = base.model_copy(update={"trial_id": f"t{i:03d}"})
        ledger.append(result, mlflow_run_id=None)
        ledger.update(result.trial_id, mlflow_run_id=f"run-{i}")
    rows, patches = sizes[0::2], sizes[1::2]
    assert max(rows) <= 1.2 * min(rows) and max(patches) <= 1.2 * min(patches)
    assert len(ledger.rows()) == 40


def test_a_one_file_ledger_is_read_then_migrated_once(root):
    study = storage.join(root, "old")
    legacy = [result_to_row(_result(1), mlflow_run_id="r1", recorded_at=1.0)]
    blob = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(legacy), blob)
    storage.Folder(study).write(LEDGER_FILE, blob.getvalue().to_pybytes())

    ledger = Ledger(ledger_path("old", root))
    assert ledger.exists() and not ledger.part_names()
    assert json.dumps(ledger.rows()) == json.dumps(legacy)  # NaN == NaN as text
    ledger.append(_world2())
    again = Ledger(ledger_path("old", root))
    again.append(_result(4))
    parts = again.part_names()
    migrated = [n for n in parts if "-migrated-" in n]
    assert len(migrated) == 1 and parts[0] == migrated[0]  # once, and read first
    assert storage.Folder(storage.join(study, PARTS_DIR)).read(migrated[0]) == (
        blob.getvalue().to_pybytes())  # the old file's bytes, as they were
    assert [r["world_size"] for r in again.rows()] == [1, 2, 4]
    assert again.rows()[0]["mlflow_run_id"] == "r1"
    # The old file stays until an export replaces it with the whole ledger.
    assert storage.Folder(study).exists(LEDGER_FILE)
    again.export()
    table = pq.read_table(pa.BufferReader(storage.Folder(study).read(LEDGER_FILE)))
    assert table.column("world_size").to_pylist() == [1, 2, 4]


def test_ledger_takes_its_path_its_study_folder_or_its_parts_folder(tmp_path):
    Ledger(ledger_path("s", tmp_path)).append(_result(1))
    for path in (tmp_path / "s" / LEDGER_FILE, tmp_path / "s", tmp_path / "s" / PARTS_DIR):
        assert len(Ledger(path).rows()) == 1, path
        assert Ledger(path).path == tmp_path / "s" / LEDGER_FILE
    assert Ledger(tmp_path / "none").rows() == [] and not Ledger(tmp_path / "none").exists()


def test_a_read_starts_from_the_export_and_reads_only_later_parts(root, monkeypatch):
    ledger = Ledger(ledger_path("s", root))
    first, second = _result(1), _world2()
    ledger.append(first, mlflow_run_id=None)
    ledger.update(first.trial_id, mlflow_run_id="run-1")
    ledger.export()
    ledger.append(second, mlflow_run_id=None)
    ledger.update(first.trial_id, mlflow_run_id="run-1b")  # a patch after the export
    with monkeypatch.context() as m:  # every part folded, the export not used
        m.setattr(Ledger, "_export_base", lambda self, names: (None, names))
        full = json.dumps(ledger.rows())

    read: list[str] = []
    read_many = storage.Folder.read_many

    def counting(self, names):
        read.extend(names)
        return read_many(self, names)

    monkeypatch.setattr(storage.Folder, "read_many", counting)
    rows = ledger.rows()
    assert json.dumps(rows) == full  # the same rows as folding every part
    assert len(read) == 2 and all(n.endswith((".rows.parquet", ".patch.parquet")) for n in read)
    assert [r["mlflow_run_id"] for r in rows] == ["run-1b", None]
    # A part that sorts before the export's last one but was written after it (a writer with a
    # clock behind, or slow): the export cannot be the start; every part is read.
    late = f"{1:020d}-late-0.patch.parquet"
    patch = rows_table([{"trial_id": second.trial_id, "mlflow_run_id": "late"}])
    storage.Folder(storage.join(root, "s", PARTS_DIR)).write(late, table_bytes(patch))
    read.clear()
    assert [r["mlflow_run_id"] for r in ledger.rows()] == ["run-1b", None]  # it came first
    assert len(read) == 5

