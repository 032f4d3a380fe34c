"""Each node that a checkpointing trial's workers land on must see the trial's local storage
folder: checked in every worker as its attempt starts, so a node the autoscaler added after the
sweep's up-front check (sweep/shared_storage.py, which probes the nodes alive at submission) is
probed the first time it holds a worker, before it writes a checkpoint no other node can read.

The driver writes a marker file under the folder it gives Ray Train; a worker that cannot read it
sees another disk (its own, or a mount the driver lacks) and fails the attempt with the fix.
Object-store roots need no probe: every node reaches them by URI.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MARKER_DIR = ".node-visibility"
FIX = ("a checkpointing trial (fault_tolerance or elastic) needs a results root every node can "
       "read and write: a shared mount (NFS, EFS, FSx, Filestore) at the same path on every node, "
       "or an object-store URI such as --results-root s3://bucket/prefix")


@contextmanager
def visibility_marker(checkpointing: bool, storage_path: str | Path,
                      storage_filesystem=None) -> Iterator[str | None]:
    """A marker under a local storage folder (Ray Train's storage_path: a path, no URI and no
    file system object) for the trial's workers to find; None otherwise."""
    if not checkpointing or storage_filesystem is not None or "://" in str(storage_path):
        yield None
        return
    marker = Path(storage_path).resolve() / MARKER_DIR / uuid.uuid4().hex
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("written by the trial's driver\n")
    try:
        yield str(marker)
    finally:
        marker.unlink(missing_ok=True)


def check_visible(marker: str | None, node: str) -> None:
    """In a worker: RuntimeError with the fix when this node cannot read the driver's marker."""
    if marker is None or Path(marker).is_file():
        return
    folder = Path(marker).parent.parent
    raise RuntimeError(f"storage: node {node} cannot see the results root's folder {folder}; {FIX}")
