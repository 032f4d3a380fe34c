"""Which physical devices a trial runs on, node by node: CUDA device UUIDs mapped to NVML handles.

Why UUIDs: CUDA numbers devices after ``CUDA_VISIBLE_DEVICES`` (a worker given physical GPU 5 sees it
as ``cuda:0``), NVML ignores that variable and numbers every GPU of the machine. The UUID is the one name
both agree on, so a meter that looks its devices up by UUID reads exactly the trial's GPUs, whatever
the visibility mask, the trial's world size or another trial sharing the node.

API
---
``gather_node_devices(device) -> NodeDevices`` (collective: every rank calls it, outside the timed
loop). Each rank contributes (node key, rank, its device UUID or None); every rank gets back its node's
ranks and UUIDs and whether it is the node's meter owner (the lowest rank on the node). The node key is
the kernel's boot id (one per machine, shared by containers and namespaces on it, which share its
counters too), else the hostname.

``nvml_handles(nvml, uuids) -> {uuid: handle}`` enumerates NVML's devices and matches UUIDs (raises
when one is missing, e.g. a MIG instance, whose energy NVML does not report per instance).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

BOOT_ID = "/proc/sys/kernel/random/boot_id"


def normalize_uuid(uuid: str | bytes) -> str:
    """NVML spelling: "GPU-" + 8-4-4-4-12 lower-case hex. Accepts NVML's own form (str or bytes) and
    torch's (the bare 8-4-4-4-12 form that ``str(props.uuid)`` prints)."""
    text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    text = text.strip().strip("\0").lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            return prefix.upper() + text[len(prefix):]
    return "GPU-" + text


def uuid_from_bytes(raw: bytes) -> str:
    """16 raw UUID bytes (``cudaDeviceProp.uuid``) -> NVML spelling."""
    h = raw.hex()
    return normalize_uuid(f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}")


def cuda_device_uuid(device: Any) -> str | None:
    """UUID of a CUDA device in NVML spelling; None for a CPU device."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    uuid = torch.cuda.get_device_properties(index).uuid
    raw = getattr(uuid, "bytes", None)  # torch._C._CUuuid: 16 raw bytes; its repr is 8-4-4-4-12 hex
    return uuid_from_bytes(raw) if isinstance(raw, bytes) and len(raw) == 16 else normalize_uuid(str(uuid))


def node_key() -> str:
    """One key per machine: the kernel boot id (shared by every container on it), else the hostname."""
    try:
        with open(BOOT_ID) as f:
            return f"boot:{f.read().strip()}"
    except OSError:
        return f"host:{socket.gethostname()}"


@dataclass(frozen=True)
class NodeDevices:
    """This rank's node as the trial uses it."""

    node: str
    rank: int
    ranks: list[int] = field(default_factory=list)  # the trial's ranks on this node, ascending
    uuids: list[str] = field(default_factory=list)  # their devices (NVML spelling), once each

    @property
    def owner_rank(self) -> int:
        return self.ranks[0]

    @property
    def is_owner(self) -> bool:
        """Exactly one rank per node meters it."""
        return self.rank == self.owner_rank


def group_by_node(entries: list[tuple[str, int, str | None]], rank: int) -> NodeDevices:
    """(node key, rank, uuid) of every rank -> this rank's NodeDevices (pure; see gather_node_devices)."""
    mine = next(node for node, r, _ in entries if r == rank)
    on_node = sorted((r, u) for node, r, u in entries if node == mine)
    uuids: list[str] = []
    for _, u in on_node:
        if u is not None and u not in uuids:
            uuids.append(u)
    return NodeDevices(mine, rank, [r for r, _ in on_node], uuids)


def gather_node_devices(device: Any = "cpu", node: str | None = None) -> NodeDevices:
    """Collective over the default group (see the module docstring); works without torch.distributed
    as a one-rank trial. ``node`` overrides the node key (tests, or a launcher that knows better)."""
    import torch.distributed as dist

    me = (node or node_key(), dist.get_rank() if dist.is_initialized() else 0, cuda_device_uuid(device))
    if not dist.is_initialized():
        return group_by_node([me], me[1])
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, me)
    return group_by_node([tuple(e) for e in everyone], me[1])


def nvml_handles(nvml: Any, uuids: list[str]) -> dict[str, Any]:
    """NVML handle of each UUID, found by enumerating NVML's devices (NVML numbering, all GPUs)."""
    by_uuid = {}
    for i in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        by_uuid[normalize_uuid(nvml.nvmlDeviceGetUUID(handle))] = handle
    missing = [u for u in uuids if normalize_uuid(u) not in by_uuid]
    if missing:
        raise RuntimeError(f"NVML has no device with UUID {', '.join(missing)} "
                           f"(it sees {len(by_uuid)}; MIG instances are not metered per instance)")
    return {u: by_uuid[normalize_uuid(u)] for u in uuids}


def load_nvml(nvml: Any = None) -> Any:
    """The pynvml module (nvidia-ml-py), initialised; ``nvml`` is a stand-in for tests."""
    if nvml is None:
        import pynvml as nvml
    nvml.nvmlInit()
    return nvml
