"""`precision: auto`: the fastest training precision of the device a trial runs on.

bf16 on GPUs (every catalogue GPU has bf16 or fp16 tensor cores and the trials train in bf16) and on
CPUs whose matmul has native bf16 (AVX512-BF16 or AMX-BF16: oneDNN runs bf16 GEMMs at up to twice
the fp32 rate there); fp32 on any other CPU, where PyTorch emulates bf16 matmul by conversion and it
runs several times slower than fp32 (llama2-tiny at 4 x 128 on an AMD EPYC Zen 3: 244 ms per step in
aten::mm in bf16 against 25 ms in fp32, measured for issue 14).

Resolved when the spec expands (on the driver), so the precision a trial ran at is a config column
like any other and part of its trial id: the same spec on the same machine keeps its trial ids.
On a Ray cluster of CPU nodes the driver's CPU is taken as the workers'.

The CPU question goes to torch (`torch.cpu.get_capabilities()`), imported lazily (validating a spec
for a GPU or with an explicit precision never imports torch) and asked once per process.
Overrides, in order:
  * SCALESTUDY_CPU_NATIVE_BF16=1 or 0: taken as the answer (tests; a worker CPU unlike the driver's);
  * ONEDNN_MAX_CPU_ISA set to an ISA without bf16 dot products (AVX2, AVX512_CORE, ...): oneDNN will
    not use the native instructions even where the CPU has them, so the answer is no.
"""

from __future__ import annotations

import functools
import os
from enum import Enum

from scalestudy.spec.catalog import HardwareProfile, Precision

NATIVE_BF16_ENV = "SCALESTUDY_CPU_NATIVE_BF16"
# oneDNN's ISA names below AVX512_CORE_BF16 (oneDNN docs, "CPU dispatcher control").
_ONEDNN_ISAS_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                             "AVX512_CORE_VNNI"}
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


class PrecisionChoice(str, Enum):
    """What a spec may ask for: a precision, or auto (resolved per trial, see the module doc)."""

    auto = "auto"
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


def cpu_has_native_bf16() -> bool:
    """Whether this machine's CPU matmul runs bf16 natively (see the module doc for overrides)."""
    forced = os.environ.get(NATIVE_BF16_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper() in _ONEDNN_ISAS_WITHOUT_BF16:
        return False
    return _torch_reports_native_bf16()


@functools.cache
def _torch_reports_native_bf16() -> bool:
    import torch

    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return any(bool(caps.get(flag)) for flag in _NATIVE_BF16_FLAGS)


def resolve_precision(choice: PrecisionChoice | Precision | str, hw: HardwareProfile) -> Precision:
    """The precision a trial of `choice` runs at on `hw`."""
    value = choice.value if isinstance(choice, Enum) else str(choice)
    if value != PrecisionChoice.auto.value:
        return Precision(value)
    if hw.is_gpu or cpu_has_native_bf16():
        return Precision.bf16
    return Precision.fp32
