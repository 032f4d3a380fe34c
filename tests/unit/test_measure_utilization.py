"""CPU utilization of this process and NVML utilization sampling."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from scalestudy.measure.utilization import CpuUtilization, NvmlUtilization, cpu_utilization
from tests.fixtures.nvml import IndexedNvml


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


class PolledNvml(IndexedNvml):
    """NVML of devices whose utilization is only polled (no nvmlDeviceGetSamples), one rate each."""

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=self.devices[h], memory=0)


def test_nvml_utilization_mean_per_device():
    u = NvmlUtilization(PolledNvml([40, 90]), interval_s=0.005)
    u.start()
    time.sleep(0.03)
    assert u.stop() == pytest.approx({"gpu0": 40.0, "gpu1": 90.0})


class BufferedNvml:
    """A driver that keeps its own utilization samples (nvmlDeviceGetSamples) for two GPUs; the test
    plays the driver with `emit`. Every NVML call is counted with the thread that made it."""

    NOT_FOUND = 6

    class Error(Exception):
        def __init__(self, value):
            super().__init__(f"NVML error {value}")
            self.value = value

    def __init__(self):
        self.buffer: dict[int, list[tuple[int, float]]] = {0: [], 1: []}
        self.clock_us = 1_000_000
        self.calls: list[tuple[str, str]] = []

    def emit(self, *values: float) -> None:
        """One driver sample per GPU (1/6 s apart), GPU 1 at half GPU 0's value."""
        self.clock_us += 166_667
        for gpu in self.buffer:
            self.buffer[gpu].append((self.clock_us, values[0] / (1 + gpu)))

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetSamples(self, h, sampling_type, since_us):
        import threading

        assert sampling_type == 1  # NVML_GPU_UTILIZATION_SAMPLES
        self.calls.append(("samples", threading.current_thread().name))
        new = [SimpleNamespace(timeStamp=t, sampleValue=SimpleNamespace(uiVal=int(v)))
               for t, v in self.buffer[h] if t > since_us]
        if not new:
            raise self.Error(self.NOT_FOUND)
        return 1, new

    def nvmlDeviceGetUtilizationRates(self, h):
        raise AssertionError("the driver's buffer is read, not polled")


def test_nvml_buffer_is_read_at_the_windows_edges_and_excluded_time_is_left_out():
    nvml = BufferedNvml()
    nvml.emit(5)  # before the window: not in it
    u = NvmlUtilization(nvml, drain_s=3600.0)  # no drain during this short window
    assert u.buffered
    u.start()
    at_start = len(nvml.calls)
    for v in (80, 100, 90):
        nvml.emit(v)  # the timed steps run; nothing of ours calls NVML meanwhile
    assert len(nvml.calls) == at_start
    u.pause()  # a checkpoint save
    nvml.emit(0)
    nvml.emit(0)
    u.resume()
    nvml.emit(50)
    got = u.stop()
    assert got == pytest.approx({"gpu0": 80.0, "gpu1": 40.0})  # (80 + 100 + 90 + 50) / 4, halved
    # Every call came from the window's edges (start, pause, resume, stop), in the caller's thread.
    assert {thread for _, thread in nvml.calls} == {"MainThread"}


def test_nvml_buffer_drained_in_a_long_window_counts_each_sample_once():
    nvml = BufferedNvml()
    u = NvmlUtilization(nvml, drain_s=0.001)
    u.start()
    for v in range(10, 110, 10):  # 10 .. 100, some drained by the thread, the rest at stop
        nvml.emit(v)
        time.sleep(0.003)
    got = u.stop()
    assert got == pytest.approx({"gpu0": 55.0, "gpu1": 27.5})
    assert any(thread == "nvml-util" for _, thread in nvml.calls)


def test_nvml_polled_where_the_driver_keeps_no_buffer_rarely_and_once_at_stop():
    """No nvmlDeviceGetSamples for the device: polled every POLL_S (not 0.1 s), plus once at stop, so
    a window shorter than the poll period still has its figure."""
    from scalestudy.measure.utilization import POLL_S

    u = NvmlUtilization(PolledNvml([70]))
    assert not u.buffered and u.interval_s == POLL_S >= 1.0
    u.start()
    assert u.stop() == {"gpu0": 70.0}
