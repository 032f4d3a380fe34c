"""The memory estimate against hand-computed bytes: model states per ZeRO stage, Hugging Face Llama's
saved activations, the phase that holds the peak, and the terms a real GPU run adds."""

from __future__ import annotations

import pytest

from scalestudy.errors import InfeasibleTrial
from scalestudy.perfmodel import memory
from scalestudy.perfmodel.memory import (GIB, MIB, TERMS, check_memory, memory_breakdown,
                                         model_states_bytes, weights_per_device)
from scalestudy.spec.load import validate_spec
from scalestudy.spec.study import expand

N_7B = 6_738_415_616  # llama2-7b parameters (32000*4096*2 + 32 layers + final norm)
EMB_7B = 32000 * 4096


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
    states = sum(model_states_bytes(_cfg(zero_stage=stage)))
    assert states == pytest.approx(N_7B * bytes_per_param, rel=1e-12)


def test_fp32_master_copy_only_under_zero():
    """torch's AdamW updates fp32 weights in place; DeepSpeed's ZeRO clones an fp32 master anyway."""
    z0 = model_states_bytes(_cfg(zero_stage=0, precision="fp32"))
    z1 = model_states_bytes(_cfg(zero_stage=1, precision="fp32"))
    assert z0 == pytest.approx((4 * N_7B, 4 * N_7B, 8 * N_7B))
    assert z1 == pytest.approx((4 * N_7B, 4 * N_7B, (4 + 8) * N_7B / 8))


def test_autotp_keeps_the_embedding_whole_megatron_splits_it():
    """A measured trial's TP is DeepSpeed AutoTP's (embedding whole on every rank); the catalogue's
    GPU profiles price the published Megatron runs (a vocab-parallel embedding, 1/tp of it)."""
    cfg = _cfg(zero_stage=0, tp=2, backend="measure")
    assert weights_per_device(cfg.model_dims, 2, 1) == pytest.approx((N_7B - EMB_7B) / 2 + EMB_7B)
    assert memory_breakdown(cfg).params_gib * GIB == pytest.approx(((N_7B - EMB_7B) / 2 + EMB_7B) * 2)
    megatron = _cfg(zero_stage=0, tp=2)
    assert memory_breakdown(megatron).params_gib * GIB == pytest.approx(N_7B / 2 * 2)
    assert sum(model_states_bytes(megatron)) < sum(model_states_bytes(cfg))


def test_hand_computed_llama_activations():
    s, b, h, f, L, V = 4096, 1, 4096, 11008, 32, 32000
    # bf16: two RMSNorms (fp32 input 4h, normalised 2h, weighted 2h), attention q, k, v, SDPA output
    # and o_proj's input (2 bytes x 5h), MLP gate, up, SiLU, product (2 bytes x 4f); logits 2 + 12.
    per_token_layer = 2 * (4 + 2 * 2) * h + 2 * 5 * h + 2 * 4 * f
    acts = L * s * b * per_token_layer + s * b * V * (2 + 12)
    assert memory.activation_bytes(_cfg(zero_stage=3)) == pytest.approx(acts)
    ckpt = L * s * b * h * 2 + s * b * per_token_layer + s * b * V * 14
    assert memory.activation_bytes(_cfg(zero_stage=3, activation_checkpointing=True)) == pytest.approx(ckpt)
    unfused = memory.activation_bytes(_cfg(zero_stage=3), fused_attention=False)
    assert unfused - acts == pytest.approx(L * s * b * (4 + 2) * 32 * s)  # fp32 softmax + bf16 copy


def test_terms_sum_to_the_total_at_the_phase_that_holds_the_peak():
    """ZeRO-0 in fp32 at dp 8, checkpointed: the gradients and their flattened all-reduce bucket
    outweigh the few activations checkpointing keeps, so the peak is at the end of the backward
    (torch's fused AdamW steps fp32 weights in place, with no temporaries)."""
    cfg = _cfg(zero_stage=0, activation_checkpointing=True, seq_len=512, precision="fp32")
    m = memory_breakdown(cfg)
    assert set(m.terms_gib) == set(TERMS)
    assert m.total_gib == pytest.approx(sum(m.terms_gib.values()), rel=1e-12)
    grads = N_7B * 4
    flat = min(N_7B, memory.ZERO0_ALLREDUCE_BUCKET_ELEMENTS) * 4
    assert m.grads_gib * GIB == pytest.approx(grads) and m.buckets_gib * GIB == pytest.approx(flat)
    assert m.activations_gib == 0.0
    dynamic = grads + flat
    f = memory.GPU_FRAGMENTATION_FRACTION
    assert m.fragmentation_gib * GIB == pytest.approx(dynamic * f / (1 - f))


def test_gpu_terms_of_a_zero3_run():
    m = memory_breakdown(_cfg(zero_stage=3))
    assert m.buckets_gib * GIB == pytest.approx(5e8 * 2)  # reduce bucket, allocated whole
    assert m.nccl_gib * GIB == pytest.approx(4 * MIB * 32 * 2)  # one communicator (world = dp)
    assert m.runtime_gib * GIB == pytest.approx(memory.CUDA_CONTEXT_BYTES)
    # gathered: the blocks the reuse distance keeps (3 for 7B), the LM head and the prefetch bucket
    block = 4 * 4096**2 + 3 * 4096 * 11008
    assert m.gathered_gib * GIB == pytest.approx((3 * block + EMB_7B + 5e7) * 2)


def test_cpu_buckets_count_their_written_pages_only():
    """The same ZeRO-3 trial: a GPU's caching allocator holds the whole 5e8-element reduce bucket; a
    CPU core's RSS holds the pages the gradients were written to."""
    data = {"name": "t", "model": "llama2-tiny", "backend": "simulate", "world_size": 2,
            "zero_stage": 3, "seq_len": 128, "micro_batch": 4, "precision": "fp32"}
    (gpu,) = expand(validate_spec({**data, "hardware": "a100-80gb"}))
    (cpu,) = expand(validate_spec({**data, "hardware": "cpu-local"}))
    n = gpu.config.model_dims.num_params()
    gpu_m, cpu_m = memory_breakdown(gpu.config), memory_breakdown(cpu.config)
    assert gpu_m.buckets_gib * GIB == pytest.approx(5e8 * 4)
    assert cpu_m.buckets_gib * GIB == pytest.approx(n * 4)
    assert cpu_m.nccl_gib == 0.0 and cpu_m.runtime_gib * GIB == pytest.approx(memory.CPU_PROCESS_BYTES)


def test_a_70b_zero3_layout_at_74_of_76_usable_gib_is_refused():
    """Pure ZeRO-3 on 16 H100s, checkpointed, 4,096 tokens: the estimate without the runtime's terms
    (states, activations, 1 GiB of overhead and two gathered blocks) put it at 74.3 GiB of 76 usable.
    The reduce bucket, the NCCL buffers, the CUDA context and the allocator's fragmentation take it
    over the line."""
    cfg = _cfg(model="llama2-70b", hardware="h100-80gb", world_size=16, zero_stage=3,
               activation_checkpointing=True)
    m = memory_breakdown(cfg)
    states = sum(model_states_bytes(cfg)) / GIB
    assert 64 < states < 65
    runtime_terms = m.buckets_gib + m.nccl_gib + m.runtime_gib + m.fragmentation_gib
    assert runtime_terms > 3.5, m.terms_gib
    assert m.total_gib > 76.0, m.terms_gib
    with pytest.raises(InfeasibleTrial, match="needs 7\\d.\\d GiB per device, has 80 GiB"):
        check_memory(cfg)


def test_published_layouts_take_their_activations_from_memory_layouts():
    from scalestudy.perfmodel import memory_layouts

    cfg = _cfg(zero_stage=1, tp=2)
    sp = cfg.model_copy(update={"sequence_parallel": True})
    assert memory.activation_bytes(sp) == pytest.approx(memory_layouts.activation_bytes(sp))
    assert memory.activation_bytes(cfg) != pytest.approx(memory_layouts.activation_bytes(cfg))


def test_check_memory_reason():
    check_memory(_cfg(zero_stage=3))  # ~47 GiB on an 80 GiB device: fine
    with pytest.raises(InfeasibleTrial, match=r"needs 1\d\d\.\d GiB per device, has 80 GiB"):
        check_memory(_cfg(zero_stage=0))


def test_check_memory_keeps_five_percent_free():
    from scalestudy.perfmodel.memory import MEMORY_MARGIN_FRACTION, usable_memory_gib

    assert MEMORY_MARGIN_FRACTION == 0.05 and usable_memory_gib(80) == pytest.approx(76.0)
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
