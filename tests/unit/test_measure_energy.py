"""Energy meters: RAPL on a temporary powercap tree, NVML against a stand-in NVML module."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from scalestudy.measure.energy import (
    EnergyReading, NoMeter, NvmlMeter, RaplMeter, counter_delta, energy_metrics, integrate_power_j,
    is_meter_owner, make_meter, rapl_domains,
)


def _domain(path: Path, name: str, uj: int, max_uj: int) -> Path:
    path.mkdir(parents=True)
    (path / "name").write_text(name + "\n")
    (path / "energy_uj").write_text(f"{uj}\n")
    (path / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return path


@pytest.fixture
def powercap(tmp_path):
    root = tmp_path / "powercap"
    p0 = _domain(root / "intel-rapl:0", "package-0", 900, 1000)
    _domain(p0 / "intel-rapl:0:0", "core", 5, 1000)  # inside the package: not counted again
    _domain(p0 / "intel-rapl:0:1", "dram", 100, 1000)
    _domain(root / "intel-rapl:1", "package-1", 10, 1000)
    _domain(root / "intel-rapl:2", "psys", 0, 1000)  # platform domain overlaps the packages
    return root


def test_counter_delta_wraps():
    assert counter_delta(900, 950, 1000) == 50
    assert counter_delta(900, 100, 1000) == 201  # 900 -> 1000 (100), 0 (1), -> 100 (100)


def test_rapl_reads_packages_and_dram_with_wraparound(powercap):
    assert [d.name for d in rapl_domains(str(powercap))] == ["package-0", "package-0/dram", "package-1"]
    meter = RaplMeter(str(powercap))
    meter.start()
    (powercap / "intel-rapl:0" / "energy_uj").write_text("300\n")  # wrapped: 101 + 300 = 401 uJ
    (powercap / "intel-rapl:0" / "intel-rapl:0:1" / "energy_uj").write_text("150\n")  # +50
    (powercap / "intel-rapl:1" / "energy_uj").write_text("60\n")  # +50
    time.sleep(0.01)
    r = meter.stop()
    assert r.source == "rapl" and r.reason is None
    assert r.energy_j == pytest.approx(501e-6)
    assert set(r.power_w_per_device) == {"package-0", "package-1"}
    assert r.power_w_per_device["package-0"] == pytest.approx(451e-6 / r.duration_s)


def test_no_rapl_gives_nan_and_reason(tmp_path):
    meter = make_meter("rapl", powercap_root=str(tmp_path / "absent"))
    assert isinstance(meter, NoMeter)
    meter.start()
    r = meter.stop()
    assert r.source == "none" and math.isnan(r.energy_j) and "RAPL" in r.reason
    assert math.isnan(energy_metrics(r, 1000)["tokens_per_j"])


class StandInNvml:
    """Records every call; GPU 1 has no energy counter (like a pre-Volta part)."""

    def __init__(self):
        self.energy_mj = {0: 1_000_000, 1: None, 2: 5_000}
        self.power_mw = {1: 200_000}
        self.calls = []

    def nvmlInit(self):
        self.calls.append(("init",))

    def nvmlDeviceGetCount(self):
        return 3

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("handle", i)

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        self.calls.append(("energy", h[1]))
        if self.energy_mj[h[1]] is None:
            raise RuntimeError("NVMLError_NotSupported")
        return self.energy_mj[h[1]]

    def nvmlDeviceGetPowerUsage(self, h):
        self.calls.append(("power", h[1]))
        return self.power_mw[h[1]]


def test_nvml_counter_is_read_per_device_and_differenced():
    nvml = StandInNvml()
    meter = NvmlMeter(nvml, sample_interval_s=0.005)
    meter.start()
    nvml.calls.clear()
    nvml.energy_mj[0] += 30_000  # 30 J on GPU 0
    nvml.energy_mj[2] += 1_500  # 1.5 J on GPU 2
    time.sleep(0.05)
    r = meter.stop()
    assert ("energy", 0) in nvml.calls and ("energy", 2) in nvml.calls
    assert ("power", 0) not in nvml.calls and ("power", 1) in nvml.calls  # fallback only where needed
    assert r.source == "nvml" and "gpu1" in r.reason
    assert r.power_w_per_device["gpu0"] == pytest.approx(30.0 / r.duration_s)
    assert r.power_w_per_device["gpu2"] == pytest.approx(1.5 / r.duration_s)
    # GPU 1: 200 W sampled over (nearly) the whole window
    assert r.power_w_per_device["gpu1"] == pytest.approx(200.0, rel=0.1)
    assert r.energy_j == pytest.approx(31.5 + r.power_w_per_device["gpu1"] * r.duration_s)


def test_only_the_node_owner_meters():
    assert is_meter_owner(0) and not is_meter_owner(1)
    assert isinstance(make_meter("nvml", local_rank=1, nvml=StandInNvml()), NoMeter)
    assert isinstance(make_meter("nvml", local_rank=0, nvml=StandInNvml()), NvmlMeter)
    with pytest.raises(ValueError, match="unknown energy source"):
        make_meter("gpu", local_rank=0)  # a source is named for its counter, not a device kind


def test_integrate_power_trapezoid():
    assert integrate_power_j([(0.0, 100.0), (1.0, 200.0), (3.0, 200.0)]) == pytest.approx(550.0)
    assert math.isnan(integrate_power_j([(0.0, 1.0)]))


def test_energy_metrics():
    m = energy_metrics(EnergyReading(10.0, 2.0, {"a": 3.0, "b": 2.0}, "nvml"), tokens=1000)
    assert m == {"energy_j": 10.0, "power_w": 2.5, "energy_per_token_j": 0.01, "tokens_per_j": 100.0}
