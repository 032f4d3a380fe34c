"""CPU utilization of this process and NVML utilization sampling."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from scalestudy.measure.utilization import CpuUtilization, NvmlUtilization, cpu_utilization


def test_busy_loop_is_about_one_core_and_sleep_is_about_zero():
    u = CpuUtilization()
    u.start()
    t = time.perf_counter()
    while time.perf_counter() - t < 0.2:
        pass
    busy = u.stop()["cpu"]
    u.start()
    time.sleep(0.2)
    idle = u.stop()["cpu"]
    # one thread cannot use more than one core; on a shared machine it may get less than one
    assert idle + 0.1 < busy <= 1.05, (idle, busy)


def test_cpu_utilization_empty_window_is_nan():
    assert cpu_utilization(1.0, 0.0) != cpu_utilization(1.0, 0.0)


def test_nvml_utilization_mean_per_device():
    class Nvml:
        def nvmlInit(self):
            pass

        def nvmlDeviceGetCount(self):
            return 2

        def nvmlDeviceGetHandleByIndex(self, i):
            return i

        def nvmlDeviceGetUtilizationRates(self, h):
            return SimpleNamespace(gpu=[40, 90][h], memory=0)

    u = NvmlUtilization(Nvml(), interval_s=0.005)
    u.start()
    time.sleep(0.03)
    assert u.stop() == pytest.approx({"gpu0": 40.0, "gpu1": 90.0})
