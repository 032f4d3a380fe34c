"""Issue 35's layout terms, one test each of direction and size: sequence and context parallelism,
selective recomputation, gather granularity, overlapped TP collectives, FP8 GEMMs, the framework
family's software efficiency, the scale effect at fixed global batch and the study's two headline
figures (settings: tests/validation/data/SOURCES.md, 'Issue 35: the headline figures')."""

from __future__ import annotations

import pytest

from scalestudy.perfmodel import compute, layouts, memory, memory_layouts
from scalestudy.perfmodel import parallelism as par
from scalestudy.perfmodel.params import params_for
from scalestudy.perfmodel.predict import predict, simulate
from scalestudy.spec.load import validate_spec
from scalestudy.spec.study import expand

BASE = {"name": "layouts", "backend": "simulate", "model": "llama2-70b", "hardware": "h100-80gb",
        "seq_len": 4096, "precision": "bf16", "world_size": 64, "zero_stage": 1, "tp": 8,
        "micro_batch": 1, "global_batch": 64, "activation_checkpointing": True}


def _cfg(**kw):
    (planned,) = expand(validate_spec({**BASE, **kw}))
    assert planned.feasible, planned.reason
    return planned.config


def _step(cfg, **params):
    p = params_for(cfg.hardware_profile).model_copy(update=params)
    return simulate(cfg, p)[0].step_s


def _tp_comms(cfg):
    return [c for c in par.communication(cfg, params_for(cfg.hardware_profile)) if c.group == "tp"]


# Sequence parallelism ----------------------------------------------------------------------------

def test_sequence_parallelism_keeps_tp_bytes_adds_a_latency_and_shards_the_norms():
    plain, sp = _cfg(), _cfg(sequence_parallel=True)
    ar, agrs = _tp_comms(plain), _tp_comms(sp)
    assert [c.kind for c in ar] == ["all_reduce"]
    assert sorted(c.kind for c in agrs) == ["all_gather", "reduce_scatter"]
    # the same bus bytes (an all-reduce is a reduce-scatter and an all-gather), one more latency
    busbw = {"all_reduce": 2 * 7 / 8, "all_gather": 7 / 8, "reduce_scatter": 7 / 8}
    assert sum(c.bytes * busbw[c.kind] for c in agrs) == pytest.approx(
        sum(c.bytes * busbw[c.kind] for c in ar))
    assert sum(c.time_s for c in agrs) > sum(c.time_s for c in ar)
    # norm and residual traffic runs on 1/tp of the tokens: compute falls
    p = params_for(plain.hardware_profile)
    assert compute.compute_times(sp, p).forward_s < compute.compute_times(plain, p).forward_s
    # Korthikanti et al. 2022: 34/t against 10 + 24/t per s*b*h (fused attention), no recompute
    a0 = memory_layouts.activation_bytes(_cfg(activation_checkpointing=False))
    a1 = memory_layouts.activation_bytes(_cfg(activation_checkpointing=False, sequence_parallel=True))
    logits = 4096 * 32000 / 8 * 6
    assert (a1 - logits) / (a0 - logits) == pytest.approx((34 / 8) / (10 + 24 / 8))


# Selective recomputation -------------------------------------------------------------------------

def test_selective_recompute_reruns_the_attention_core_only():
    p = params_for(_cfg().hardware_profile)
    full, sel, none = (_cfg(activation_checkpointing=v) for v in ("full", "selective", "none"))
    ct_full, ct_sel = compute.compute_times(full, p), compute.compute_times(sel, p)
    assert ct_sel.recompute_s == pytest.approx(ct_sel.attention_forward_s)
    assert 0 < ct_sel.recompute_s < 0.25 * ct_full.recompute_s
    # no TP collective reruns (the attention core is inside the TP region)
    c_full, c_sel, c_none = (sum(x.calls_per_step for x in _tp_comms(c)) for c in (full, sel, none))
    assert c_sel == c_none < c_full
    smaller = {"model_dims": _cfg(model="llama2-13b").model_dims}  # 70B without recompute: OOM
    r_full, r_sel, r_none = (predict(c.model_copy(update=smaller)) for c in (full, sel, none))
    assert r_none.hfu == pytest.approx(r_none.mfu)
    assert r_sel.mfu > r_full.mfu and r_sel.hfu > r_sel.mfu
    # memory: the unfused score tensors go, the rest of the block stays (Korthikanti, Table 2)
    dims = sel.model_dims
    u_sel, u_none = (memory_layouts.activation_bytes(c, fused_attention=False) for c in (sel, none))
    scores = 5 * dims.num_heads * 4096 / (dims.hidden_size * 8)
    assert u_sel < u_none
    assert memory_layouts.activation_bytes(full) < memory_layouts.activation_bytes(sel)
    logits = 4096 * 32000 / 8 * 6
    assert (u_sel - logits) / (u_none - logits) == pytest.approx(
        (10 + 24 / 8) / (10 + 24 / 8 + scores))


def test_checkpointing_words_keep_the_ids_of_booleans():
    for word, flag in (("full", True), ("none", False)):
        assert _cfg(activation_checkpointing=word).trial_id == _cfg(activation_checkpointing=flag).trial_id
    assert _cfg(activation_checkpointing="selective").trial_id != _cfg().trial_id


# Context parallelism -----------------------------------------------------------------------------

def test_context_parallelism_splits_tokens_and_hides_its_ring_behind_attention():
    long = dict(model={"name": "llama2-7b-1m", "dims": {"architecture": "llama", "hidden_size": 4096,
                "num_layers": 32, "num_heads": 32, "num_kv_heads": 32, "ffn_hidden_size": 11008,
                "vocab_size": 32000, "max_seq_len": 131072}}, tp=1, zero_stage=1,
                activation_checkpointing=False, world_size=8, global_batch=8)
    one, two = _cfg(**long, seq_len=32768), _cfg(**long, seq_len=32768, cp=2)
    assert two.dp == one.dp and two.grad_accum == 2 * one.grad_accum
    p = params_for(one.hardware_profile)
    c1, c2 = compute.compute_times(one, p), compute.compute_times(two, p)
    assert c2.gemm_forward_s == pytest.approx(c1.gemm_forward_s / 2, rel=0.02)
    assert c2.attention_forward_s < 0.55 * c1.attention_forward_s
    exp_f, exp_b, total = layouts.cp_exposed_s(two, p, c2.attention_forward_s, c2.attention_backward_s)
    assert total > 0 and exp_f == exp_b == 0.0  # 32k keys: a chunk's attention hides its K/V step
    short = _cfg(**{**long, "global_batch": 1}, seq_len=1024, cp=8)
    cs = compute.compute_times(short, p)
    exp_f, exp_b, total = layouts.cp_exposed_s(short, p, cs.attention_forward_s,
                                               cs.attention_backward_s)
    assert 0 < exp_f + exp_b < total
    half = memory_layouts.activation_bytes(two) / memory_layouts.activation_bytes(one)
    assert half == pytest.approx(0.5)


# Gather granularity ------------------------------------------------------------------------------

H1 = dict(model="llama2-7b", tp=1, zero_stage=3, global_batch=2048, activation_checkpointing=True)


def test_block_gathers_issue_one_gather_per_block():
    cfg = _cfg(**H1, world_size=2048, micro_batch=1, gather_granularity="block")
    gathers = [c for c in par.communication(cfg, params_for(cfg.hardware_profile))
               if c.kind == "all_gather"]
    blocks = cfg.model_dims.num_layers
    # forward: every block and the root; recompute: every block but the last, and the root
    assert sum(c.calls_per_step for c in gathers) == 2 * blocks - 1 + 2
    module = _cfg(**H1, world_size=2048, micro_batch=1)
    assert sum(c.calls_per_step for c in par.communication(module, params_for(module.hardware_profile))
               if c.kind == "all_gather") > 2.5 * blocks


def test_the_zero3_collapse_follows_from_the_latency_per_gather():
    """At 2,048 H100s, one sequence per GPU: DeepSpeed's per-module gathers (three per block) take
    far longer than FSDP's per-block ones; with the collectives' latency set to nothing, the two
    granularities move the same bytes and their steps agree."""
    kw = dict(H1, world_size=2048, micro_batch=1)
    module, block = _cfg(**kw), _cfg(**kw, gather_granularity="block")
    assert _step(module) > 1.3 * _step(block)
    flat = dict(latency_scale=1e-9, net_overhead_s=0.0)
    assert _step(module, **flat) == pytest.approx(_step(block, **flat), rel=0.05)


# Item 7 and the headline figures -----------------------------------------------------------------

def _per_device(world: int, **params) -> float:
    cfg = _cfg(**H1, world_size=world, micro_batch=2048 // world, gather_granularity="block")
    return cfg.tokens_per_step / _step(cfg, **params) / world


def test_per_gpu_decline_at_fixed_global_batch_grows_with_gpus_and_comes_from_the_terms():
    worlds = (128, 256, 512, 1024, 2048)
    rates = [_per_device(w) for w in worlds]
    assert all(b < a for a, b in zip(rates, rates[1:]))  # falls, and faster as GPUs grow
    drops = [b / a for a, b in zip(rates, rates[1:])]
    assert drops[-1] < drops[0]
    # the headline: FSDP 7B on H100, 2,048 against 128 GPUs, in the study's band
    assert 0.45 <= rates[-1] / rates[0] <= 0.8
    # with no latency per hop, the fall nearly vanishes: it comes from the terms, not a constant
    flat = [_per_device(w, latency_scale=1e-9, net_overhead_s=0.0) for w in (128, 2048)]
    assert flat[1] / flat[0] > 0.9


def test_h100_over_a100_mfu_at_1024_gpus_is_in_the_studys_band():
    kw = dict(H1, world_size=1024, micro_batch=2, gather_granularity="block")
    h100, a100 = predict(_cfg(**kw)), predict(_cfg(**kw, hardware="a100-80gb"))
    assert 0.5 <= h100.mfu / a100.mfu <= 0.9


# TP overlap, FP8, software efficiency -------------------------------------------------------------

def test_overlapped_tp_collectives_expose_less_and_cost_some_compute():
    plain = _cfg(sequence_parallel=True)
    over = _cfg(sequence_parallel=True, tp_comm_overlap=True)
    r0, r1 = predict(plain), predict(over)
    assert r1.comm_exposed_s < 0.6 * r0.comm_exposed_s
    assert r1.step_time_s < r0.step_time_s
    assert r1.step_time_s > r0.compute_time_s  # hiding is never free (overlap_slowdown)


def test_fp8_gemms_run_faster_but_less_than_twice_and_attention_stays_16_bit():
    p = params_for(_cfg().hardware_profile)
    bf, f8 = compute.compute_times(_cfg(), p), compute.compute_times(_cfg(fp8=True), p)
    # at 4,096 tokens a micro-batch, casting the weights and the activations takes a good share
    assert 1.15 < bf.gemm_forward_s / f8.gemm_forward_s < 2.0
    assert f8.attention_forward_s == pytest.approx(bf.attention_forward_s)
    assert predict(_cfg(fp8=True)).tokens_per_s > predict(_cfg()).tokens_per_s


def test_software_efficiency_scales_a_compute_bound_step():
    cfg = _cfg(tp=1, world_size=8, zero_stage=1, model="llama2-7b", global_batch=8)
    ratio = _step(cfg, software_efficiency=0.8) / _step(cfg)
    assert 1.2 < ratio <= 1.25 + 1e-9


# Memory: the one memory rule takes these layouts' activations from memory_layouts.py --------------

@pytest.mark.parametrize("kw", [dict(sequence_parallel=True), dict(cp=2, global_batch=128),
                                dict(activation_checkpointing="selective", sequence_parallel=True),
                                dict(fp8=True)])
def test_the_memory_model_prices_layout_options_with_their_terms(kw):
    cfg = _cfg(**kw)
    for fused in (True, False):
        assert memory.activation_bytes(cfg, fused) == pytest.approx(
            memory_layouts.activation_bytes(cfg, fused))


def test_selective_recompute_alone_frees_the_hugging_face_attention_core():
    """Selective recomputation without the Megatron-only options is what the measure backend runs
    (the SDPA core under torch's checkpoint): every block keeps what it keeps without recompute but
    the core's own tensors -- SDPA's output, and with eager attention the softmax -- which is a
    little below none and far above full (Hugging Face's Llama; memory_measured.yaml's sel-*)."""
    full, sel, none = (_cfg(activation_checkpointing=v, tp=1, world_size=8, global_batch=8)
                       for v in ("full", "selective", "none"))
    dims, s, b, a = sel.model_dims, 4096, 1, 2
    layers = dims.num_layers
    for fused in (True, False):
        u_full, u_sel, u_none = (memory.activation_bytes(c, fused) for c in (full, sel, none))
        core = a * dims.hidden_size + (0 if fused else (4 + a) * dims.num_heads * s)
        assert u_none - u_sel == pytest.approx(layers * s * b * core)
        assert u_full < u_sel < u_none
    # the SDPA output is a small share of a fused block (h of ~6h + 2k + 4f per token at 2 bytes)
    assert 0.95 < memory.activation_bytes(sel) / memory.activation_bytes(none) < 1.0


def test_interleaved_and_fp8_activation_memory():
    base = dict(pp=4, global_batch=256, activation_checkpointing=False)
    plain = memory_layouts.activation_bytes(_cfg(**base))
    assert memory_layouts.activation_bytes(_cfg(**base, fp8=True)) < plain
    interleaved = _cfg(**base).model_copy(update={"virtual_stages": 2})
    # Korthikanti Sec. 4.2.3: 1 + (p - 1) / (p * v) times the 1F1B first stage's layers
    assert memory_layouts.activation_bytes(interleaved) > plain
    logits = 4096 * 32000 / 8 * 6
    assert (memory_layouts.activation_bytes(interleaved) - logits) / (plain - logits) == (
        pytest.approx(1 + 3 / 8))
