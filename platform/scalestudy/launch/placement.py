"""Where a measured trial's workers go: the Ray Train scaling config of a trial, the controller's
health-check interval, and the check at a trial's start that every TP group shares one node.

A trial that fits in one node gets STRICT_PACK: Ray places all its workers on one node or none, so
its collectives never cross the network. A larger trial takes whole nodes (the layout refuses a
world size that is not a multiple of the devices per node, parallel/layout.py): it leases whole
idle nodes and its workers are pinned to them (launch/node_leases.py), so a concurrent trial never
shares one; Ray Train orders ranks node by node, so each node holds consecutive ranks and a TP
group (tp consecutive ranks, tp <= devices per node) stays inside one. Every worker still reports
its node at the start and the trial fails with the reason when a TP group crosses nodes: an
elastic or fault-tolerant trial is not pinned (it must restart on whatever nodes are up).

A Ray instance this process started itself (ray.init with no cluster to join) has fixed resources
and no autoscaler: a trial it cannot hold would wait placement_timeout_s for nodes that never come,
so `local_shortfall` turns it away at once, recorded as a placement timeout (retried by --resume,
e.g. once the study runs on a cluster). On a cluster joined, nodes may still come: it waits.

The decisions are pure; only `gather_node_ids` and `check_tp_nodes` (run in the workers) and
`on_this_node` (the launcher's helper actors) touch Ray and torch.distributed, lazily.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scalestudy.parallel.layout import Layout
from scalestudy.spec.catalog import HardwareProfile
from scalestudy.spec.trial import TrialConfig

# The controller polls every worker once per interval. 0.2 s on a small local cluster shortens each
# report and the end of a trial by ~2 s (Ray's default is 2 s); at thousands of GPU workers that
# would be thousands of polls a second, so a GPU trial keeps Ray's default until it has more than
# POLLS_PER_S_GPU * 2 s workers and then scales the interval with its workers.
HEALTH_CHECK_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
LOCAL_HEALTH_CHECK_S = 0.2
RAY_DEFAULT_HEALTH_CHECK_S = 2.0
POLLS_PER_S_GPU = 128


@dataclass(frozen=True)
class Placement:
    """The placement part of a trial's ray.train.ScalingConfig."""

    num_workers: int | tuple[int, int]
    use_gpu: bool
    resources_per_worker: dict[str, float]
    placement_strategy: str
    accelerator_type: str | None
    extra: dict[str, Any] = field(default_factory=dict)

    def scaling_kwargs(self) -> dict:
        return {"num_workers": self.num_workers, "use_gpu": self.use_gpu,
                "resources_per_worker": dict(self.resources_per_worker),
                "placement_strategy": self.placement_strategy,
                "accelerator_type": self.accelerator_type, **self.extra}

    @property
    def min_workers(self) -> int:
        """The workers the trial cannot start without (an elastic trial's minimum)."""
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[0]

    def describe(self) -> str:
        """One line for a reason: what the trial waited for."""
        acc = f", accelerator_type {self.accelerator_type}" if self.accelerator_type else ""
        pinned = self.extra.get("label_selector")
        nodes = f", pinned to {len({s['ray.io/node-id'] for s in pinned})} leased nodes" if pinned else ""
        return (f"{self.min_workers} x {self.resources_per_worker} "
                f"({self.placement_strategy}{acc}{nodes})")


# A worker's resources are the profile's (HardwareProfile.ray_resources_per_worker, the one place
# they are computed). These two names remain only for calibrate/across_nodes.py, which imports them.
def profile_device_resource(hw: HardwareProfile) -> str:
    return hw.ray_device_resource


def profile_resources(hw: HardwareProfile) -> dict[str, float]:
    return hw.ray_resources_per_worker()


def placement_for(cfg: TrialConfig, selectors: list[dict[str, str]] | None = None) -> Placement:
    """The trial's placement: STRICT_PACK when its world fits in one node, else PACK over whole
    nodes (the layout has refused a fixed world that does not fill them), pinned to the nodes it
    leased when `selectors` are given (launch/node_leases.py: per worker, Ray's node-id label). An
    elastic trial always packs loosely: it exists to grow onto nodes that arrive and to survive
    one that goes, which a group held to a single node could do only by restarting elsewhere
    whole (the autoscaling test grows a 1-worker trial onto a new 1-CPU node)."""
    el, hw = cfg.elastic, cfg.hardware_profile
    one_node = el is None and cfg.world_size <= hw.gpus_per_node
    extra: dict = {"elastic_resize_monitor_interval_s": el.resize_check_s} if el else {}
    if selectors:
        extra["label_selector"] = selectors
    return Placement(
        num_workers=(el.min_workers, el.max_workers) if el else cfg.world_size,
        # Ray Train's use_gpu asks for Ray's "GPU" resource: not for a custom one (fake clusters)
        use_gpu=hw.ray_device_resource == "GPU",
        resources_per_worker=hw.ray_resources_per_worker(),
        placement_strategy="STRICT_PACK" if one_node else "PACK",
        accelerator_type=hw.accelerator_type,
        extra=extra,
    )


def local_shortfall(cfg: TrialConfig, available: dict[str, float]) -> str | None:
    """Why the trial's workers can never be placed on a Ray instance of fixed resources
    (`available`, its totals), or None. Only a necessary condition: Ray still has to fit them."""
    p = placement_for(cfg)
    need = {k: v * p.min_workers for k, v in p.resources_per_worker.items()}
    if p.accelerator_type:
        need[f"accelerator_type:{p.accelerator_type}"] = 1e-3  # any node of that type
    short = sorted(k for k, v in need.items() if available.get(k, 0.0) + 1e-9 < v)
    if not short:
        return None
    have = {k: available.get(k, 0.0) for k in short}
    return (f"placement: needs {p.describe()}, and the Ray instance this process started has "
            f"{have} with no autoscaler to add nodes; run it on a Ray cluster (RAY_ADDRESS or "
            "`ray job submit`), or ask for fewer devices")


def health_check_interval_s(cfg: TrialConfig) -> float:
    """Short on CPU (local) trials; Ray's default on GPU clusters, longer past
    POLLS_PER_S_GPU * 2 s workers so the controller's polls stay under POLLS_PER_S_GPU a second."""
    if not cfg.hardware_profile.is_gpu:
        return LOCAL_HEALTH_CHECK_S
    workers = cfg.elastic.max_workers if cfg.elastic else cfg.world_size
    return max(RAY_DEFAULT_HEALTH_CHECK_S, workers / POLLS_PER_S_GPU)


def tp_node_reason(layout: Layout, node_of_rank: list[str]) -> str | None:
    """Why the trial may not run on these nodes, or None: a TP group crossing nodes."""
    off = layout.tp_groups_off_node(node_of_rank)
    if not off:
        return None
    group = off[0]
    nodes = sorted({node_of_rank[r][:8] for r in group})
    return (f"placement: TP group {group} spans nodes {', '.join(nodes)} "
            f"({len(off)} of {len(layout.tp_groups())} TP groups cross nodes); "
            "a TP group must share one node")


def on_this_node() -> dict:
    """Actor options that keep a helper actor (a trial's channel, the sweep's warm pool, calibrate's
    progress relay) on this process's node, so that losing another node never takes it along. Hard
    node affinity: Ray places an actor that asks for no resources on a random node ("effectively
    SPREAD", Ray's scheduling docs), and a soft affinity did not hold it (Ray 2.60, fake three-node
    cluster: 5 of 8 soft-pinned 0-CPU actors elsewhere, 0 of 8 hard-pinned). Should this node die,
    the process that needs the actor died with it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=False)}


def gather_node_ids() -> list[str]:
    """Every rank's Ray node id, in rank order (torch.distributed is up)."""
    import ray
    import torch.distributed as dist

    mine = ray.get_runtime_context().get_node_id()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def check_tp_nodes(cfg: TrialConfig) -> list[str]:
    """In every worker at the start of an attempt: the ranks' nodes, or RuntimeError with the
    reason when a TP group of this attempt's layout crosses nodes."""
    node_ids = gather_node_ids()
    reason = tp_node_reason(cfg.layout.resized(len(node_ids)), node_ids)
    if reason:
        raise RuntimeError(reason)
    return node_ids


# The catalogue's accelerator types that name a memory size (A100-40G, A100-80G): Ray labels a node
# with the GPU model only (accelerator_type:A100, from NVML's name), so only the launchers' node
# types declare these (cluster/aws-a100.yaml). Matched within this fraction of the profile's memory:
# NVML reports 79.6 GiB for an 80 GB A100 and 39.4 GiB for a 40 GB one.
SIZED_MEMORY_TOLERANCE = 0.1


def sized_accelerator_resources(devices: list[tuple[str, float]],
                                profiles: list[HardwareProfile]) -> dict[str, float]:
    """The sized accelerator resource that the machine's GPUs (NVML name, memory GiB) answer to,
    e.g. {"accelerator_type:A100-80G": 1} for eight "NVIDIA A100-SXM4-80GB", else {} (no GPU, mixed
    GPUs, or a model whose catalogue type is unsized, which Ray declares itself)."""
    labels = set()
    for name, memory_gib in devices:
        matches = {p.accelerator_type for p in profiles
                   if p.accelerator_type and "-" in p.accelerator_type
                   and p.accelerator_type.split("-")[0] in name
                   and abs(memory_gib - p.hbm_gib) <= SIZED_MEMORY_TOLERANCE * p.hbm_gib}
        labels.add(matches.pop() if len(matches) == 1 else None)
    if len(labels) != 1 or None in labels:
        return {}
    return {f"accelerator_type:{labels.pop()}": 1.0}


def local_gpu_devices(nvml=None) -> list[tuple[str, float]]:
    """(NVML name, memory GiB) of each GPU of this machine; [] where NVML is missing or fails (a CPU
    machine). ``nvml``: a stand-in for tests."""
    from scalestudy.measure.devices import load_nvml

    try:
        nvml = load_nvml(nvml)
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        return [(_text(nvml.nvmlDeviceGetName(h)), nvml.nvmlDeviceGetMemoryInfo(h).total / 2**30)
                for h in handles]
    except Exception:  # noqa: BLE001  ImportError without nvidia-ml-py, NVMLError without a driver
        return []


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
