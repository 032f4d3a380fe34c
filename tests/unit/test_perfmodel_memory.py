"""Memory estimate against hand-computed bytes (llama2-7b, 8 devices, ZeRO 0..3)."""

from __future__ import annotations

import pytest

from scalestudy.perfmodel.memory import GIB, check_memory, memory_breakdown
from scalestudy.spec.errors import InfeasibleTrial
from scalestudy.spec.load import validate_spec
from scalestudy.spec.study import expand

N_7B = 6_738_415_616  # llama2-7b parameters (32000*4096*2 + 32 layers + final norm)


def _cfg(**axes):
    data = {"name": "t", "model": "llama2-7b", "hardware": "a100-80gb", "backend": "simulate",
            "world_size": 8, "seq_len": 4096, "micro_batch": 1, **axes}
    (p,) = expand(validate_spec(data))
    assert p.config is not None, p.reason
    return p.config


@pytest.mark.parametrize(
    "stage, bytes_per_param",
    [
        (0, 2 + 2 + 12),            # nothing sharded
        (1, 2 + 2 + 12 / 8),        # optimizer states / dp
        (2, 2 + (2 + 12) / 8),      # + gradients / dp
        (3, (2 + 2 + 12) / 8),      # + weights / dp
    ],
)
def test_llama2_7b_model_states_per_zero_stage(stage, bytes_per_param):
    m = memory_breakdown(_cfg(zero_stage=stage))
    states = (m.params_gib + m.grads_gib + m.optimizer_gib) * GIB
    assert states == pytest.approx(N_7B * bytes_per_param, rel=1e-12)


def test_hand_computed_activations_and_total():
    m = memory_breakdown(_cfg(zero_stage=3))
    s, b, h, L, V = 4096, 1, 4096, 32, 32000
    acts = L * s * b * h * 34 + s * b * V * (2 + 4)  # fused attention: no 5as/h term
    assert m.activations_gib * GIB == pytest.approx(acts)
    layer = 4 * h * h + 3 * h * 11008 + 2 * h
    overhead = 1.0 * GIB + 2 * layer * 2
    assert m.overhead_gib * GIB == pytest.approx(overhead)
    assert m.total_gib * GIB == pytest.approx(N_7B * 2 + acts + overhead)


def test_unfused_attention_adds_score_tensors():
    cfg = _cfg(zero_stage=3)
    fused, unfused = memory_breakdown(cfg), memory_breakdown(cfg, fused_attention=False)
    extra = 32 * 5 * 32 * 4096 * 4096 * 1  # L * 5 a s^2 b
    assert (unfused.activations_gib - fused.activations_gib) * GIB == pytest.approx(extra)


def test_tp_checkpointing_and_fp32():
    base = memory_breakdown(_cfg(zero_stage=0, tp=2))
    assert (base.params_gib * GIB) == pytest.approx(N_7B / 2 * 2)
    ckpt = memory_breakdown(_cfg(zero_stage=0, tp=2, activation_checkpointing=True))
    assert ckpt.activations_gib < base.activations_gib / 5
    fp32 = memory_breakdown(_cfg(zero_stage=0, precision="fp32"))
    assert (fp32.params_gib + fp32.grads_gib + fp32.optimizer_gib) * GIB == pytest.approx(16 * N_7B)


def test_check_memory_reason():
    check_memory(_cfg(zero_stage=3))  # ~31 GiB on an 80 GiB device: fine
    with pytest.raises(InfeasibleTrial, match=r"needs 1\d\d\.\d GiB per device, has 80 GiB"):
        check_memory(_cfg(zero_stage=0))


def test_check_memory_keeps_five_percent_free():
    from scalestudy.perfmodel.memory import DEVICE_MEMORY_FREE_FRACTION, usable_memory_gib

    assert DEVICE_MEMORY_FREE_FRACTION == 0.05 and usable_memory_gib(80) == pytest.approx(76.0)
    cfg = _cfg(zero_stage=3)
    need = memory_breakdown(cfg).total_gib
    # a device with 2% to spare is too small: the trial needs 5% of it free
    tight = cfg.model_copy(update={"hardware_profile": cfg.hardware_profile.model_copy(
        update={"hbm_gib": need / 0.98})})
    with pytest.raises(InfeasibleTrial, match="5% is kept free"):
        check_memory(tight)
    roomy = cfg.model_copy(update={"hardware_profile": cfg.hardware_profile.model_copy(
        update={"hbm_gib": need / 0.94})})
    check_memory(roomy)
