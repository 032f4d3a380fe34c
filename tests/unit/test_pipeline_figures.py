"""A pipeline trial's figures from its ranks' readings, the ZeRO-1 owner rule, and the performance
model's pipeline terms (bubble with unequal stages, p2p operations and bytes) (issue 33)."""

from __future__ import annotations

import math

import pytest

from scalestudy.perfmodel import parallelism as par
from scalestudy.perfmodel.compute import ComputeTimes
from scalestudy.perfmodel.overlap import fill_speedup, pipeline_bubble
from scalestudy.perfmodel.params import params_for
from scalestudy.spec.load import validate_spec
from scalestudy.spec.study import expand
from scalestudy.train.pipeline_summary import PipelineReading, RankReading, pipeline_reading

TINY4 = {"name": "pp-tiny4", "dims": {"architecture": "llama", "hidden_size": 64, "num_layers": 4,
                                      "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 176,
                                      "vocab_size": 256, "max_seq_len": 128}}


def _gpipe_rows(m: int, f: float, b: float, steps: int = 3) -> list[RankReading]:
    """Two balanced stages as GPipe runs them with free transfers: each busy m(f + b) of a span of
    (m + 1)(f + b)."""
    span = (m + 1) * (f + b) * steps
    return [RankReading(rank=r, pp_rank=r, steps=steps, blocks=2, forward_s=m * f * steps,
                        backward_s=m * b * steps, span_s=span, p2p_wait_s=0.0,
                        p2p_ops=2 * m * steps, p2p_bytes=2 * m * 1000 * steps, dp_comm_s=0.0,
                        optimizer_s=0.01 * steps, peak_memory_gib=1.0 + 0.1 * (1 - r))
            for r in range(2)]


@pytest.mark.parametrize("m", [2, 4, 8])
def test_ideal_gpipe_readings_give_narayanans_bubble(m):
    r = pipeline_reading(_gpipe_rows(m, 0.01, 0.02), "gpipe", 1, m)
    assert math.isclose(r.bubble_fraction, 1 / (m + 1))
    assert math.isclose(r.expected_bubble_fraction, 1 / (m + 1))
    assert math.isclose(r.bubble_time_s, 0.03) and math.isclose(r.span_s, (m + 1) * 0.03)
    assert r.p2p_ops == 2 * m and r.p2p_bytes == 2000 * m  # per step
    assert r.stage_imbalance == 1.0
    assert [s.peak_memory_gib for s in r.stages] == [1.1, 1.0]


def test_readings_average_replicas_and_show_imbalance():
    rows = _gpipe_rows(4, 0.01, 0.02) + [
        row.model_copy(update={"rank": row.rank + 2, "forward_s": 2 * row.forward_s})
        for row in _gpipe_rows(4, 0.01, 0.02)]  # a second dp replica, slower forwards
    rows[1] = rows[1].model_copy(update={"backward_s": 0.0, "forward_s": 0.0})
    r = pipeline_reading(rows, "1f1b", 1, 4)
    stage0, stage1 = r.stages
    assert math.isclose(stage0.forward_s, (0.04 + 0.08) / 2)
    assert stage1.busy_s < stage0.busy_s and r.stage_imbalance > 1


def test_interleaving_divides_the_expected_bubble():
    r = PipelineReading(schedule="interleaved_1f1b", virtual_stages=2, micro_batches=4,
                        stages=pipeline_reading(_gpipe_rows(4, 0.01, 0.02), "x", 2, 4).stages)
    assert math.isclose(r.expected_bubble_fraction, 0.5 / 4.5)


def test_zero1_owners_balance_the_elements():
    import torch

    from scalestudy.train.stage_replicas import _owners

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (100, 10, 60, 50, 5)]
    owners = _owners(params, 2)
    load = [sum(p.numel() for p, o in zip(params, owners) if o == r) for r in range(2)]
    assert owners[0] == 0 and sorted(load) == [110, 115]
    assert _owners(params, 2) == owners  # the same on every rank


# --- the performance model ---------------------------------------------------------------------

def _cfg(**spec):
    base = {"name": "pp", "model": TINY4, "hardware": "cpu-local", "precision": "fp32",
            "backend": "simulate"}
    (p,) = expand(validate_spec({**base, **spec}))
    assert p.feasible, p.reason
    return p.config


CT = ComputeTimes(forward_s=0.5, backward_s=1.0, recompute_s=0.0, optimizer_s=0.1, stage_layers=2,
                  block_forward_s=0.1, block_backward_s=0.2)  # 0.6 per micro-batch in its blocks


def test_balanced_bubble_without_blocks_is_pp_minus_one_slots_over_v():
    assert pipeline_bubble(2.0, CT, 4, 4, 1, None) == (2.0, 3 * 2.0)
    assert pipeline_bubble(2.0, CT, 4, 4, 2, None) == (2.0, 1.5 * 2.0)
    assert pipeline_bubble(2.0, CT, 4, 1, 1, None) == (2.0, 0.0)


def test_bubble_with_each_ranks_blocks():
    slot = CT.micro_batch_s  # 1.5: two blocks (0.6) and the head and loss (0.9) on the last stage
    # equal blocks: the first stage lacks the head, so its fill and drain take 0.6, not 1.5
    pace, bubble = pipeline_bubble(slot, CT, 4, 2, 1, (2, 2))
    assert pace == slot and math.isclose(bubble, 0.6)
    # 3 + 1 blocks: the last stage (1 block and the head, 1.2) still paces; the first fills 0.9
    pace, bubble = pipeline_bubble(slot, CT, 4, 2, 1, (3, 1))
    assert math.isclose(pace, 1.2) and math.isclose(bubble, 0.9)
    # 6 + 1: the first stage (1.8) paces the last (1.2), which fills and drains once
    pace, bubble = pipeline_bubble(slot, CT, 4, 2, 1, (6, 1))
    assert math.isclose(pace, 1.8) and math.isclose(bubble, 1.2)
    # interleaved: every other slot filled and drained over V
    assert math.isclose(pipeline_bubble(slot, CT, 4, 2, 2, (2, 2))[1], 0.3)


def test_fill_and_drain_run_at_the_speed_of_a_less_busy_node():
    assert fill_speedup(2, 2.0) == 2.0  # two stages fill and drain alone
    assert math.isclose(fill_speedup(4, 2.0), 2.0 / (1 + 1 / 3))
    assert fill_speedup(8, 1.0) == 1.0  # GPUs share nothing: no speed-up
    slot = CT.micro_batch_s + 0.1  # 0.1 s of blocking communication a micro-batch
    assert math.isclose(pipeline_bubble(slot, CT, 4, 2, 1, None, 2.0)[1], 0.1 + 1.5 / 2)
    assert math.isclose(pipeline_bubble(slot, CT, 4, 2, 1, (2, 2), 2.0)[1], 0.1 + 0.6 / 2)


def test_p2p_operations_and_bytes_per_rank():
    p = params_for(_cfg(world_size=2, pp=2, global_batch=4).hardware_profile)
    for spec, ops in [({"world_size": 2, "pp": 2, "global_batch": 4}, 8),
                      ({"world_size": 4, "pp": 4, "global_batch": 8}, 4 * 8 * 3 / 4),
                      ({"world_size": 2, "pp": 2, "global_batch": 4, "schedule": "interleaved_1f1b",
                        "virtual_stages": 2}, 4 * 4 * 3 / 2)]:
        cfg = _cfg(**spec)
        assert par.p2p_ops_per_rank(cfg, p) == ops
        (pp_comm,) = [c for c in par.communication(cfg, p) if c.group == "pp"]
        assert pp_comm.calls_per_step == ops and pp_comm.bytes_per_call == 128 * 64 * 4


def test_measured_pipelines_send_whole_activations_over_tp():
    spec = {"world_size": 4, "pp": 2, "tp": 2, "global_batch": 4}
    sim, meas = _cfg(**spec), _cfg(**spec, backend="measure")
    p = params_for(sim.hardware_profile)
    (a,) = [c for c in par.communication(sim, p) if c.group == "pp"]
    (b,) = [c for c in par.communication(meas, p) if c.group == "pp"]
    assert b.bytes_per_call == 2 * a.bytes_per_call


def test_pipeline_blocks_per_rank():
    assert par.pipeline_blocks(_cfg(world_size=1)) is None
    cfg = _cfg(world_size=2, pp=2, global_batch=4, schedule="interleaved_1f1b", virtual_stages=2)
    assert par.pipeline_blocks(cfg) == (2, 2)
    assert par.pipeline_blocks(_cfg(world_size=2, pp=2, global_batch=4,
                                    last_stage_fewer_layers=2)) == (3, 1)


def test_bf16_stage_parameters_step_from_fp32_masters():
    """A 16-bit stage steps as DeepSpeed's bf16 does: Adam on fp32 masters, the parameters their
    16-bit copies, so an update too small for bf16 still accumulates in the master."""
    import torch

    from scalestudy.train.stage_replicas import ReplicaOptimizer

    cfg = _cfg(world_size=2, pp=2, global_batch=4)
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = ReplicaOptimizer([p], cfg, dp_group=None, dp_size=1, dp_rank=0)
    assert opt.masters[0].dtype == torch.float32
    for _ in range(3):
        p.grad = torch.full((4,), 1.0, dtype=torch.bfloat16)
        opt.step()
        assert p.grad is None
    # AdamW's first steps move each weight by ~lr (1e-3): 1 - 3e-3 in fp32, rounded to bf16
    assert torch.allclose(opt.masters[0], torch.full((4,), 1 - 3e-3), atol=1e-5)
    assert p.dtype == torch.bfloat16 and torch.equal(p.data, opt.masters[0].to(torch.bfloat16))
