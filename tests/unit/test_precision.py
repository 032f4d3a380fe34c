"""`precision: auto`: bf16 on GPUs and on CPUs with native bf16 matmul, fp32 on other CPUs; the
precision a trial ran at is its `precision` column (and MLflow param), the spec's request beside it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from scalestudy.spec import precision as P
from scalestudy.spec.catalog import Precision, get_hardware
from scalestudy.spec.load import load_spec, validate_spec
from scalestudy.plan import plan_study
from scalestudy.spec.study import expand
from tests.conftest import QUICKSTART

CPU, GPU = get_hardware("cpu-local"), get_hardware("h100-80gb")


def _trial(**spec):
    base = {"name": "p", "model": "llama2-tiny", "hardware": "cpu-local"}
    (p,) = expand(validate_spec({**base, **spec}))
    return p


@pytest.mark.parametrize("native, expect", [("1", Precision.bf16), ("0", Precision.fp32)])
def test_auto_follows_the_cpu(monkeypatch, native, expect):
    monkeypatch.setenv(P.NATIVE_BF16_ENV, native)
    assert P.resolve_precision("auto", CPU) is expect
    assert P.resolve_precision("auto", GPU) is Precision.bf16  # every GPU profile trains in bf16
    p = _trial(precision="auto")
    assert p.config.precision is expect and p.config.precision_requested is P.PrecisionChoice.auto
    assert p.axes["precision"] == "auto"


def test_onednn_capped_below_bf16_counts_as_no_native_bf16(monkeypatch):
    monkeypatch.delenv(P.NATIVE_BF16_ENV, raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    assert not P.cpu_has_native_bf16()


def test_without_overrides_torch_is_asked(monkeypatch):
    monkeypatch.delenv(P.NATIVE_BF16_ENV, raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    import torch

    caps = torch.cpu.get_capabilities()
    assert P.cpu_has_native_bf16() == bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def test_an_explicit_precision_is_kept(monkeypatch):
    monkeypatch.setenv(P.NATIVE_BF16_ENV, "0")
    p = _trial(precision="bf16")
    assert p.config.precision is Precision.bf16 and p.config.precision_requested.value == "bf16"


def test_same_trial_ids_whether_auto_or_the_precision_it_resolves_to(monkeypatch):
    for native, resolved in (("1", "bf16"), ("0", "fp32")):
        monkeypatch.setenv(P.NATIVE_BF16_ENV, native)
        auto = [p.config.trial_id for p in plan_study(load_spec(QUICKSTART))]
        explicit = [p.config.trial_id for p in plan_study(load_spec(QUICKSTART, [f"precision={resolved}"]))]
        assert auto == explicit


def test_columns_hold_the_precision_used(monkeypatch):
    from scalestudy.perfmodel.predict import predict

    monkeypatch.setenv(P.NATIVE_BF16_ENV, "0")
    row = predict(_trial(precision="auto", backend="simulate").config).model_dump(mode="json")
    assert (row["precision"], row["precision_requested"]) == ("fp32", "auto")


def test_validating_a_gpu_spec_never_imports_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from scalestudy.spec.load import validate_spec\nfrom scalestudy.spec.study import expand\n"
            "(p,) = expand(validate_spec({'name': 'g', 'model': 'llama2-7b', 'hardware': 'h100-80gb',"
            " 'world_size': 8, 'seq_len': 4096}))\nprint(p.config.precision.value)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "bf16"
