"""A Ray that `scalestudy run` starts on a single GPU machine declares the sized accelerator type
the catalogue's A100 profiles ask for (Ray itself labels the node accelerator_type:A100 only), from
NVML's device names and memory; launch/placement.py. NVML is a stand-in here (no GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from scalestudy.launch.placement import local_gpu_devices, sized_accelerator_resources
from scalestudy.spec import catalog
from tests.fixtures.nvml import IndexedNvml

GIB = 2**30
PROFILES = [catalog.get_hardware(n) for n in catalog.hardware_names()]


class FakeNvml(IndexedNvml):
    """The calls local_gpu_devices makes, over (name, total bytes) per device."""

    def nvmlDeviceGetName(self, h):
        return self.devices[h][0]

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=self.devices[h][1])


@pytest.mark.parametrize("name, total_gib, expected", [
    (b"NVIDIA A100-SXM4-80GB", 79.6, {"accelerator_type:A100-80G": 1.0}),
    ("NVIDIA A100-SXM4-40GB", 39.4, {"accelerator_type:A100-40G": 1.0}),
    ("NVIDIA A100 80GB PCIe", 79.2, {"accelerator_type:A100-80G": 1.0}),
    ("NVIDIA H100 80GB HBM3", 79.6, {}),  # unsized in the catalogue: Ray's own label serves
    ("NVIDIA A100-SXM4-40GB", 60.0, {}),  # no A100 profile of that size
])
def test_each_gpu_answers_to_the_profile_of_its_model_and_memory(name, total_gib, expected):
    devices = local_gpu_devices(FakeNvml([(name, total_gib * GIB)] * 8))
    assert len(devices) == 8 and isinstance(devices[0][0], str)
    assert sized_accelerator_resources(devices, PROFILES) == expected


def test_mixed_gpus_or_none_declare_nothing():
    mixed = local_gpu_devices(FakeNvml([("NVIDIA A100-SXM4-80GB", 79.6 * GIB),
                                        ("NVIDIA A100-SXM4-40GB", 39.4 * GIB)]))
    assert sized_accelerator_resources(mixed, PROFILES) == {}
    assert sized_accelerator_resources([], PROFILES) == {}


def test_a_machine_without_nvml_has_no_gpus():
    class Broken(FakeNvml):
        def nvmlInit(self):
            raise RuntimeError("NVML Shared Library Not Found")

    assert local_gpu_devices(Broken([])) == []
