"""Where a rank's checkpoint files are staged and read: its own shards only, on a local disk the
node names, fetched from the results root on the first read.

Saves: every rank writes what DeepSpeed gives it (its own ZeRO shards; the module states only on
the ranks DeepSpeed has write them) into a folder under the staging root, and the adapter uploads
that folder (Ray Train merges the ranks' folders into one checkpoint). Restores: the checkpoint's
listing comes first, as empty placeholders, so that DeepSpeed's own globbing and naming decide which
files this rank needs; a file is downloaded only when DeepSpeed (or the ZeRO-3 re-partitioner,
train/zero3_resize.py) opens it, through `reading(engine)`, which also counts the bytes. On a
72-rank 70B ZeRO-3 restore each rank pulls ~1/72 of the optimizer state instead of all of it
(what `Checkpoint.as_directory()` did: the whole checkpoint per node, into the system temp dir).

The staging root is the node's: $SCALESTUDY_STAGING_DIR (the launchers point it at the instance's
NVMe where it has one), else the system temp dir. A checkpoint on a file system this process sees
(a local results root, a shared mount) is read in place: nothing is copied.

No Ray here: the adapter hands over a pyarrow file system and a path (launch/worker.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STAGING_ENV = "SCALESTUDY_STAGING_DIR"
# Files below this size are fetched with the listing: loop state, manifests, `latest`.
METADATA_BYTES = 1 << 20


def staging_root() -> str:
    """The node's local disk for checkpoint staging (created if missing)."""
    root = os.environ.get(STAGING_ENV) or tempfile.gettempdir()
    os.makedirs(root, exist_ok=True)
    return root


@contextmanager
def staging_dir(prefix: str) -> Iterator[str]:
    """A fresh folder under the staging root, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix=prefix, dir=staging_root()) as d:
        yield d


@dataclass(frozen=True)
class StoredCheckpoint:
    """A checkpoint as the adapter knows it: a pyarrow file system and the path on it."""

    filesystem: Any
    path: str

    @classmethod
    def local(cls, directory: str | Path) -> StoredCheckpoint:
        import pyarrow.fs

        return cls(pyarrow.fs.LocalFileSystem(), str(Path(directory).resolve()))

    @property
    def is_local(self) -> bool:
        import pyarrow.fs

        return isinstance(self.filesystem, pyarrow.fs.LocalFileSystem)


@dataclass
class ShardReader:
    """One rank's view of a stored checkpoint: `directory` holds every file's name, and a file's
    bytes once it was read through `fetch` (or `reading`). `bytes_read` counts what this rank
    read of the checkpoint: fetched files, or in place the files DeepSpeed loaded."""

    stored: StoredCheckpoint
    directory: str = ""
    bytes_read: int = 0
    files_read: list[str] = field(default_factory=list)
    _remote: dict[str, str] = field(default_factory=dict)  # local path -> path on the store
    _sizes: dict[str, int] = field(default_factory=dict)

    def list_into(self, directory: str) -> None:
        """Placeholders for every file of the checkpoint; small ones fetched at once."""
        import pyarrow.fs

        self.directory = directory
        selector = pyarrow.fs.FileSelector(self.stored.path, recursive=True)
        base = self.stored.path.rstrip("/") + "/" if self.stored.path else ""
        for info in self.stored.filesystem.get_file_info(selector):
            if info.type != pyarrow.fs.FileType.File:
                continue
            local = os.path.join(directory, info.path[len(base):])
            os.makedirs(os.path.dirname(local), exist_ok=True)
            open(local, "wb").close()
            self._remote[local], self._sizes[local] = info.path, info.size
            if info.size <= METADATA_BYTES:
                self.fetch(local)

    def fetch(self, local: str) -> str:
        """The file's local path, its bytes present (downloaded on the first call)."""
        local = os.path.abspath(local)
        if local in self.files_read:
            return local
        remote = self._remote.pop(local, None)
        if remote is not None:
            with self.stored.filesystem.open_input_stream(remote) as src, open(local, "wb") as dst:
                shutil.copyfileobj(src, dst, length=8 << 20)
        self.bytes_read += os.path.getsize(local)
        self.files_read.append(local)
        return local

    @contextmanager
    def reading(self, engine) -> Iterator[None]:
        """While inside: every file the DeepSpeed engine loads is fetched first and counted."""
        ckpt_engine = engine.checkpoint_engine
        original = ckpt_engine.load

        def load(path: str, map_location=None):
            return original(self.fetch(path), map_location=map_location)

        ckpt_engine.load = load
        try:
            yield
        finally:
            del ckpt_engine.load  # the class's method again


@contextmanager
def open_stored(stored: StoredCheckpoint) -> Iterator[ShardReader]:
    """A ShardReader over the checkpoint: in place when this process sees its file system, else
    listed into a staging folder that is removed on exit."""
    reader = ShardReader(stored)
    if stored.is_local:
        reader.directory = stored.path
        yield reader
        return
    with staging_dir("restore-") as d:
        reader.list_into(d)
        yield reader
