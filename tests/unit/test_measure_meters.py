"""Meters on the trial's own devices: a fake NVML node of 8 GPUs, a trial on two of them by UUID.

The stand-in implements the pynvml functions the meters call (nvmlInit, nvmlDeviceGetCount,
nvmlDeviceGetHandleByIndex, nvmlDeviceGetUUID, nvmlDeviceGetTotalEnergyConsumption,
nvmlDeviceGetPowerUsage, nvmlDeviceGetUtilizationRates) and records every device it is asked about.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from types import SimpleNamespace

import pytest

from scalestudy import metrics as M
from scalestudy.measure.devices import (
    NodeDevices, gather_node_devices, group_by_node, normalize_uuid, uuid_from_bytes,
)
from scalestudy.measure.energy import NoMeter, NvmlMeter, energy_metrics, node_energy_meter
from scalestudy.measure.meters import TrialMeters
from scalestudy.measure.utilization import NoUtilization, NvmlUtilization, node_utilization


def uuid(i: int) -> str:
    return f"GPU-{i:08x}-1111-2222-3333-{i:012x}"


class EightGpuNvml:
    """A node of 8 GPUs; every counter advances when the test says so, on all eight alike."""

    def __init__(self, no_counter: tuple[int, ...] = ()):
        self.energy_mj = {i: 1_000_000 * (i + 1) for i in range(8)}
        self.power_mw = {i: 100_000 * (i + 1) for i in range(8)}
        self.util = {i: 10 * i for i in range(8)}
        self.no_counter = set(no_counter)
        self.touched: set[int] = set()  # devices whose readings were asked for

    def advance(self, joules_each: float) -> None:
        for i in self.energy_mj:
            self.energy_mj[i] += int(joules_each * 1000 * (i + 1))

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return 8

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("h", i)

    def nvmlDeviceGetUUID(self, h):
        return uuid(h[1]).encode()  # old pynvml returned bytes; normalize_uuid takes both

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        self.touched.add(h[1])
        if h[1] in self.no_counter:
            raise RuntimeError("NVMLError_NotSupported")
        return self.energy_mj[h[1]]

    def nvmlDeviceGetPowerUsage(self, h):
        self.touched.add(h[1])
        return self.power_mw[h[1]]

    def nvmlDeviceGetUtilizationRates(self, h):
        self.touched.add(h[1])
        return SimpleNamespace(gpu=self.util[h[1]], memory=0)


TRIAL = [uuid(3), uuid(6)]  # e.g. CUDA_VISIBLE_DEVICES=3,6: the trial sees them as cuda:0 and cuda:1


def test_uuid_spellings_agree():
    raw = bytes(range(16))
    assert uuid_from_bytes(raw) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert normalize_uuid("00010203-0405-0607-0809-0A0B0C0D0E0F") == uuid_from_bytes(raw)  # torch's repr
    assert normalize_uuid(b"GPU-00010203-0405-0607-0809-0a0b0c0d0e0f\0") == uuid_from_bytes(raw)


def test_energy_meter_reads_exactly_the_trials_two_gpus():
    nvml = EightGpuNvml()
    meter = NvmlMeter(nvml, device_uuids=TRIAL)
    meter.start()
    nvml.advance(10.0)  # GPU i gains 10 * (i + 1) J: all eight advance
    r = meter.stop()
    assert nvml.touched == {3, 6}
    assert set(r.power_w_per_device) == set(TRIAL) and r.source == "nvml"
    assert r.energy_j == pytest.approx(40.0 + 70.0)
    assert r.power_w_per_device[uuid(6)] == pytest.approx(70.0 / r.duration_s)
    assert "GPU boards" in r.scope


def test_excluded_interval_is_cut_from_energy_and_duration():
    nvml = EightGpuNvml()
    meter = NvmlMeter(nvml, device_uuids=TRIAL)
    meter.start()
    nvml.advance(1.0)
    with meter.excluded():  # a checkpoint save
        nvml.advance(100.0)
        time.sleep(0.02)
    nvml.advance(2.0)
    r = meter.stop()
    assert r.energy_j == pytest.approx(3.0 * (4 + 7))  # the save's 100 J per unit is not in it
    assert r.excluded_intervals == 1 and r.excluded_s >= 0.02
    assert r.power_w_per_device[uuid(3)] == pytest.approx(3.0 * 4 / r.duration_s)


def test_sampled_power_fallback_skips_excluded_time():
    nvml = EightGpuNvml(no_counter=(3,))  # GPU 3 lacks the energy counter: 400 W sampled
    meter = NvmlMeter(nvml, device_uuids=TRIAL, sample_interval_s=0.002)
    meter.start()
    time.sleep(0.03)
    with meter.excluded():
        time.sleep(0.05)
    time.sleep(0.03)
    r = meter.stop()
    assert uuid(3) in r.reason
    # constant 400 W integrated over the active segments only
    assert r.power_w_per_device[uuid(3)] == pytest.approx(400.0, rel=0.1)
    assert r.excluded_s >= 0.05 and r.duration_s >= 0.06


def test_utilization_samples_only_the_trials_gpus_and_pauses():
    nvml = EightGpuNvml()
    u = NvmlUtilization(nvml, device_uuids=TRIAL, interval_s=0.002)
    u.start()
    time.sleep(0.02)
    with u.excluded():
        nvml.util[3] = 0  # idle while saving: not in the mean
        time.sleep(0.02)
        nvml.util[3] = 30
    time.sleep(0.01)
    assert u.stop() == {uuid(3): 30.0, uuid(6): 60.0}
    assert nvml.touched == {3, 6}


def test_one_meter_per_node_and_unknown_uuid_is_an_error():
    owner = NodeDevices("n", 0, [0, 1], TRIAL)
    other = NodeDevices("n", 1, [0, 1], TRIAL)
    assert isinstance(node_energy_meter(True, owner, nvml=EightGpuNvml()), NvmlMeter)
    assert isinstance(node_energy_meter(True, other, nvml=EightGpuNvml()), NoMeter)
    assert isinstance(node_utilization(True, other, nvml=EightGpuNvml()), NoUtilization)
    missing = NodeDevices("n", 0, [0], ["GPU-ffffffff-0000-0000-0000-000000000000"])
    meter = node_energy_meter(True, missing, nvml=EightGpuNvml())
    assert isinstance(meter, NoMeter) and "no device with UUID" in meter.reason


def test_group_by_node_picks_the_lowest_rank_and_keeps_the_nodes_uuids():
    entries = [("b", 2, uuid(0)), ("a", 1, uuid(5)), ("a", 0, uuid(4)), ("b", 3, uuid(1))]
    n = group_by_node(entries, 3)
    assert n.ranks == [2, 3] and n.uuids == [uuid(0), uuid(1)] and not n.is_owner
    assert group_by_node(entries, 0).is_owner
    single = gather_node_devices("cpu")  # no process group: a one-rank trial
    assert single.is_owner and single.uuids == []


def test_trial_meters_summary_on_one_node():
    nvml = EightGpuNvml()
    meters = TrialMeters(True, NodeDevices("n", 0, [0, 1], TRIAL), nvml=nvml)
    meters.start()
    nvml.advance(1.0)
    with meters.excluded():
        nvml.advance(50.0)
    meters.stop()
    res = meters.reduce()
    e = res.energy
    assert e.energy_j == pytest.approx(11.0) and e.source == "nvml" and e.excluded_intervals == 1
    assert energy_metrics(e, 1000)[M.ENERGY_PER_TOKEN_J] == pytest.approx(0.011)
    assert res.utilization_metric == M.DEVICE_UTILIZATION_PCT and res.devices_utilization == 2


def test_cpu_trial_meters_use_rapl_and_count_cores(tmp_path):
    """A CPU profile (is_gpu False): RAPL for energy (here absent: NaN with why), the process's CPU
    use under the cores column; NVML is never touched."""
    nvml = EightGpuNvml()
    meters = TrialMeters(False, NodeDevices("n", 0, [0], []), nvml=nvml,
                         powercap_root=str(tmp_path / "absent"))
    meters.start()
    sum(range(200_000))
    meters.stop()
    res = meters.reduce()
    assert res.energy.source == "none" and "RAPL" in res.energy.reason
    assert res.utilization_metric == M.CPU_UTILIZATION_CORES and res.utilization > 0
    assert nvml.touched == set()


# --- two real ranks on one node: one meter, both devices --------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    from scalestudy.measure.devices import group_by_node

    dist.init_process_group("gloo", rank=rank, world_size=2)
    # The gather is real (all_gather_object); the UUID is what cuda_device_uuid would return on a
    # node where this rank's CUDA_VISIBLE_DEVICES is its trial GPU.
    me = ("node-a", rank, TRIAL[rank])
    everyone: list = [None, None]
    dist.all_gather_object(everyone, me)
    node = group_by_node([tuple(e) for e in everyone], rank)
    nvml = EightGpuNvml()
    meters = TrialMeters(True, node, nvml=nvml)
    meters.start()
    nvml.advance(2.0)
    time.sleep(0.05)  # several utilization samples
    meters.stop()
    res = meters.reduce()
    with open(os.path.join(out_dir, f"r{rank}.json"), "w") as f:
        json.dump({"energy": res.energy.energy_j, "power": res.energy.power_w, "util": res.utilization,
                   "n": res.devices_utilization, "touched": sorted(nvml.touched),
                   "owner": node.is_owner}, f)
    dist.destroy_process_group()


def test_two_ranks_of_one_node_meter_it_once(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2))
    assert r0["owner"] and not r1["owner"]
    assert r0["touched"] == [3, 6] and r1["touched"] == []  # only the owner reads NVML
    for r in (r0, r1):
        assert r["energy"] == pytest.approx(2.0 * (4 + 7))  # counted once, not once per rank
        assert r["util"] == pytest.approx(45.0) and r["n"] == 2
        assert math.isfinite(r["power"])
