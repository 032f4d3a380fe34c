"""Refuse, before any trial starts, a study that checkpoints into a local results root that the other
nodes of the cluster cannot see.

A checkpointing trial (fault tolerance, elastic) persists its checkpoint from each worker's node and
restarts from it on any node, so its storage must be one that every node reads and writes. A trial
that does not checkpoint needs none (its summary returns through Ray, launch/channel.py). The check is
direct: the driver writes a marker file under the root, and a task pinned to every alive node looks
for it; a node that does not find it sees another disk (its own, or a mount the driver lacks).
Nodes the autoscaler adds later are probed by the trials themselves: every worker of a
checkpointing trial checks the same kind of marker as its attempt starts (launch/storage_probe.py).
"""

from __future__ import annotations

import uuid
from pathlib import Path

from scalestudy.errors import SpecError
from scalestudy.launch.storage_probe import FIX, MARKER_DIR
from scalestudy.track import storage



def _sees(path: str) -> bool:
    return Path(path).is_file()


def nodes_missing(root: Path) -> list[str]:
    """Alive nodes (their IPs and ids) that cannot read a marker written here under `root`."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    marker = root.resolve() / MARKER_DIR / uuid.uuid4().hex
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("written by the sweep driver\n")
    try:
        nodes = [n for n in ray.nodes() if n["Alive"]]
        probe = ray.remote(num_cpus=0)(_sees)
        refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            n["NodeID"], soft=False)).remote(str(marker)) for n in nodes]
        seen = ray.get(refs, timeout=120)
    finally:
        marker.unlink(missing_ok=True)
    return [f"{n['NodeManagerAddress']} ({n['NodeID'][:8]})"
            for n, ok in zip(nodes, seen) if not ok]


def check_checkpoint_storage(results_root: str | Path, checkpointing: bool) -> None:
    """SpecError (one line: field, value, fix) when checkpointing trials would write to a local
    root that some alive node cannot see. Object-store URIs and single-node clusters pass."""
    import ray

    loc = storage.as_location(results_root)
    if not checkpointing or not isinstance(loc, Path):
        return
    if sum(1 for n in ray.nodes() if n["Alive"]) < 2:
        return
    missing = nodes_missing(loc)
    if missing:
        raise SpecError("--results-root", str(results_root),
                        f"node(s) {', '.join(missing)} cannot see this local folder; {FIX}")
