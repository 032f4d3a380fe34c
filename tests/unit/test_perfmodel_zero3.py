"""ZeRO-3 traffic and schedule as DeepSpeed issues them (perfmodel/zero3.py, parallelism.py)."""

from __future__ import annotations

import pytest

from scalestudy.parallel.layout import Layout
from scalestudy.perfmodel import network as net
from scalestudy.perfmodel import parallelism as par
from scalestudy.perfmodel import zero3 as z3
from scalestudy.perfmodel.params import params_for
from scalestudy.perfmodel.predict import simulate
from scalestudy.spec import catalog
from scalestudy.spec.load import validate_spec
from scalestudy.spec.study import expand


def _cfg(**axes):
    data = {"name": "t", "model": "llama2-7b", "hardware": "h100-80gb", "backend": "simulate",
            "world_size": 256, "seq_len": 4096, "micro_batch": 1, "zero_stage": 3, **axes}
    (p,) = expand(validate_spec(data))
    assert p.config is not None, p.reason
    return p.config


def _calls(cfg, phase: str, kind: str = net.ALL_GATHER) -> float:
    p = params_for(cfg.hardware_profile)
    return sum(c.calls_per_step for c in par.communication(cfg, p)
               if c.phase == phase and c.kind == kind)


def test_llama_block_gathers_in_prefetch_bucket_groups():
    dims = catalog.get_model("llama2-7b")
    weights = z3.block_weights(dims, 1)
    assert len(weights) == 7  # q, k, v, o, gate, up, down; the RMSNorm weights (4,096) persist
    groups = z3.gather_groups(weights)
    assert sum(groups) == pytest.approx(dims.layer_params() - 2 * dims.hidden_size)
    assert all(g >= z3.PREFETCH_BUCKET for g in groups[:-1])
    assert len(groups) == 3  # q+k+v | o+gate | up+down at 5e7 elements per coalesced call


def test_small_parameters_persist_and_are_never_gathered():
    tiny = catalog.get_model("llama2-tiny")
    assert z3.block_weights(tiny, 1) == ()  # every weight of a block is below 1e5 elements


def test_forward_gathers_every_weight_group_once_per_micro_batch():
    cfg, dims = _cfg(), catalog.get_model("llama2-7b")
    fwd = _calls(cfg, par.FORWARD)
    assert fwd == dims.num_layers * 3 + 2  # blocks' groups + embedding + LM head
    cfg4 = _cfg(global_batch=1024)  # 4 micro-batches per step
    assert _calls(cfg4, par.FORWARD) == 4 * fwd


@pytest.mark.parametrize("ckpt", [False, True])
def test_backward_regathers_except_blocks_within_the_reuse_distance(ckpt):
    """Without checkpointing the backward gathers again; with it the recompute forward does, and the
    backward then reuses those weights: the count is the same, the last blocks are spared."""
    cfg, dims = _cfg(activation_checkpointing=ckpt), catalog.get_model("llama2-7b")
    block = dims.layer_params()
    keep = z3.retained_blocks(block, dims.lm_head_params(), dims.num_layers)
    assert keep == int((z3.MAX_REUSE_DISTANCE - dims.lm_head_params()) // (2 * block)) + 1
    assert _calls(cfg, par.BACKWARD) == (dims.num_layers - keep) * 3 + 1  # + the embedding


def test_gradients_reduce_scattered_in_reduce_bucket_size_buckets():
    cfg = _cfg()
    p = params_for(cfg.hardware_profile)
    (rs,) = [c for c in par.communication(cfg, p) if c.kind == net.REDUCE_SCATTER]
    assert rs.bytes_per_call == z3.REDUCE_BUCKET * 2
    total = catalog.get_model("llama2-7b").num_params()
    assert rs.calls_per_step * z3.REDUCE_BUCKET == pytest.approx(total)


def test_prefetch_hides_gathers_and_its_absence_exposes_them():
    cfg = _cfg(world_size=64)
    with_prefetch, _ = simulate(cfg, params_for(cfg.hardware_profile))
    without, _ = simulate(cfg, params_for(cfg.hardware_profile, zero3_prefetch=False))
    assert with_prefetch.exposed_s < 0.5 * without.exposed_s
    assert without.step_s > with_prefetch.step_s


def test_a_window_too_small_for_the_next_module_leaves_its_gather_exposed():
    """A unit larger than stage3_max_live_parameters cannot be prefetched behind the one before."""
    big = z3.MAX_LIVE * 1.5
    units = ((z3.Unit(1.0, 1.0, big), z3.Unit(1.0, 1.0, big)), 4)
    small = ((z3.Unit(1.0, 1.0, 1e8), z3.Unit(1.0, 1.0, 1e8)), 4)
    t_big, *_ = z3.run_phase((units,))
    t_small, *_ = z3.run_phase((small,))
    assert t_big == pytest.approx(16.0)  # every gather waits for its module: 8 x (1 + 1)
    assert t_small == pytest.approx(9.0)  # gathers run one unit ahead: 8 x 1 + the first gather


def test_multi_node_ring_steps_at_each_hops_own_latency():
    """NCCL's ring latency (tuning.cc): of 1,535 steps over 192 nodes, 191 cross the network at its
    hop latency and 1,344 cross NVLink at max(NVLink hop, per-step network post: 2 us on AMD hosts);
    a tiny message takes LL, the protocol with the cheapest hops. Lock-step at the network hop (the
    model before issue 35) would be ten times as long."""
    hw = catalog.get_hardware("a100-80gb")
    p = params_for(hw)
    g = net.Group.of(Layout.of(1536, devices_per_node=hw.gpus_per_node), "dp")
    tiny = net.collective_time(net.ALL_GATHER, 1536 * 2, g, hw, p)
    assert tiny == pytest.approx(6.6e-6 + 1344 * 2e-6 + 191 * 2.7e-6, rel=0.01)
    assert tiny < 0.2 * 1535 * (14e-6 + 3 * 2e-6)
