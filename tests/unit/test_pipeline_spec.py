"""Pipeline parallelism in the spec and the layout (issue 33): the stage split, the process groups
of a world-8 grid, the planner's rules for pp > 1 with their reason classes, and trial ids that the
new pipeline options leave as they were at their defaults."""

from __future__ import annotations

import re

import pytest

from scalestudy.errors import InfeasibleTrial, ReasonClass, SpecError
from scalestudy.parallel.layout import Layout, stage_layer_counts, stage_ranges
from scalestudy.plan import plan_study
from scalestudy.spec.load import validate_spec
from scalestudy.spec.study import expand
from scalestudy.spec.trial import PIPELINE_DEFAULTS, PipelineSchedule, trial_name

TINY4 = {"name": "pp-tiny4", "dims": {"architecture": "llama", "hidden_size": 64, "num_layers": 4,
                                      "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 176,
                                      "vocab_size": 256, "max_seq_len": 128}}

GPT4 = {"name": "pp-gpt4", "dims": {**TINY4["dims"], "architecture": "gpt", "num_kv_heads": 4}}


def planned(**spec):
    base = {"name": "pp", "model": TINY4, "hardware": "cpu-local", "precision": "fp32"}
    return plan_study(validate_spec({**base, **spec}))


# --- the split ----------------------------------------------------------------------------------

@pytest.mark.parametrize("args, counts", [
    ((4, 2), [2, 2]),
    ((4, 1), [4]),
    ((8, 2, 2), [2, 2, 2, 2]),          # interleaved: pp * V stages
    ((6, 4, 1, 1, 1), [1, 2, 2, 1]),    # torchtitan's "fewer" split: (6 + 2) / 4 = 2, ends give one
    ((7, 2, 1, 1, 0), [3, 4]),
    ((4, 1, 1, 3, 3), [4]),             # one stage: nothing to give up
])
def test_stage_layer_counts(args, counts):
    assert stage_layer_counts(*args) == counts
    assert sum(counts) == args[0]


@pytest.mark.parametrize("args, message", [
    ((2, 4), "pp 4 does not divide num_layers 2"),
    ((4, 2, 3), "6 pipeline stages (pp 2 x virtual_stages 3) do not divide num_layers 4"),
    ((5, 2, 1, 2, 0), "do not divide num_layers 5 + fewer first/last 2+0"),
    ((4, 4, 1, 2, 2), "every stage needs at least one"),
])
def test_stage_layer_counts_refusals(args, message):
    with pytest.raises(InfeasibleTrial, match=re.escape(message)) as err:
        stage_layer_counts(*args)
    assert err.value.reason_class is ReasonClass.model


def test_stage_ranges_are_consecutive_blocks():
    assert stage_ranges([1, 2, 2, 1]) == [range(0, 1), range(1, 3), range(3, 5), range(5, 6)]


# --- the process grid -----------------------------------------------------------------------------

GROUPS_WORLD8 = {  # arange(8).view(dp=2, pp=2, tp=2)
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
}


def test_world8_groups_of_the_layout():
    lay = Layout.of(8, tp=2, pp=2)
    assert lay.dp == 2
    assert lay.tp_groups() == GROUPS_WORLD8["tp"]
    assert lay.pp_groups() == GROUPS_WORLD8["pp"]
    assert lay.dp_groups() == GROUPS_WORLD8["dp"]


def test_world8_groups_of_the_pipeline_mesh_on_a_fake_process_group():
    """train/schedules.process_groups builds the torch device mesh every rank trains with; on a
    fake world of 8 each rank's dp, pp and tp groups are the grid's."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from scalestudy.train.schedules import process_groups

    lay = Layout.of(8, tp=2, pp=2)
    for rank in range(8):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
        try:
            got = process_groups(lay, "cpu").ranks
        finally:
            dist.destroy_process_group()
        for axis, groups in GROUPS_WORLD8.items():
            (mine,) = [g for g in groups if rank in g]
            assert got[axis] == mine, (rank, axis, got[axis])


# --- the planner's rules --------------------------------------------------------------------------

def _only(**spec):
    """The one point of a spec, refused or not (plan_study refuses a spec of no runnable point)."""
    base = {"name": "pp", "model": TINY4, "hardware": "cpu-local", "precision": "fp32"}
    (p,) = expand(validate_spec({**base, **spec}))
    return p


def test_a_pipeline_trial_is_runnable_on_the_measure_backend():
    (p,) = planned(world_size=2, pp=2, global_batch=4, zero_stage=1)
    assert p.feasible, p.reason
    assert p.config.stage_layers == [2, 2]


@pytest.mark.parametrize("spec, reason_class, words", [
    ({"world_size": 2, "pp": 2}, ReasonClass.layout, "1 micro-batch(es) per step (grad_accum) for pp 2"),
    ({"world_size": 2, "pp": 2, "global_batch": 4, "zero_stage": 2}, ReasonClass.backend, "ZeRO-2 with pp 2"),
    ({"world_size": 2, "pp": 2, "global_batch": 4, "zero_stage": 3}, ReasonClass.backend, "ZeRO-3 with pp 2"),
    ({"world_size": 4, "pp": 4, "global_batch": 8, "schedule": "interleaved_1f1b", "virtual_stages": 2},
     ReasonClass.model, "8 pipeline stages"),
    ({"world_size": 2, "pp": 2, "global_batch": 5, "micro_batch": 1, "schedule": "interleaved_1f1b",
      "virtual_stages": 2}, ReasonClass.layout, "not a multiple of its 2 rounds"),
    ({"world_size": 2, "pp": 2, "global_batch": 4, "model": GPT4}, ReasonClass.backend,
     "llama models only"),
])
def test_pipeline_refusals(spec, reason_class, words):
    p = _only(**spec)
    assert not p.feasible
    assert p.reason_class is reason_class, p.reason
    assert words in p.reason


def test_zero3_with_pp_is_still_predicted():
    """The refusal is the measured pipeline's: the performance model prices ZeRO-3 with pp."""
    p = _only(world_size=2, pp=2, global_batch=4, zero_stage=3, backend="simulate")
    assert p.feasible, p.reason


def test_fp16_pipelines_are_refused_where_fp16_runs():
    p = _only(hardware="a100-80gb", precision="fp16", world_size=2, pp=2, global_batch=4)
    assert p.reason_class is ReasonClass.precision and "loss scaler" in p.reason


@pytest.mark.parametrize("spec, words", [
    ({"schedule": "interleaved_1f1b"}, "virtual_stages: 2"),
    ({"schedule": "1f1b", "virtual_stages": 2}, "only schedule: interleaved_1f1b"),
    ({"schedule": "zero_bubble"}, "schedule"),
])
def test_schedule_options_are_checked_with_the_spec(spec, words):
    with pytest.raises(SpecError, match=words):
        validate_spec({"name": "pp", "model": "llama2-tiny", "hardware": "cpu-local", **spec})


# --- identity -------------------------------------------------------------------------------------

def _configs(**spec):
    base = {"name": "ids", "model": TINY4, "hardware": "cpu-local", "backend": "simulate",
            "world_size": [1, 2], "pp": [1, 2], "global_batch": 8}
    return {p.config.run_name: p.config for p in expand(validate_spec({**base, **spec}))}


def test_pipeline_options_at_their_defaults_keep_trial_ids():
    plain = _configs()
    explicit = _configs(schedule="1f1b", virtual_stages=1, first_stage_fewer_layers=0,
                        last_stage_fewer_layers=0)
    assert {n: c.trial_id for n, c in plain.items()} == {n: c.trial_id for n, c in explicit.items()}
    for cfg in plain.values():  # the hashed payload is the one written before the options existed
        assert not PIPELINE_DEFAULTS.keys() & cfg.model_dump().keys()
        assert cfg.config_fields()["schedule"] == "1f1b"  # the column shows the default


def test_pipeline_options_change_pipeline_trial_ids_only():
    plain, gpipe = _configs(), _configs(schedule="gpipe")
    for name, cfg in plain.items():
        other = gpipe[name.replace("-pp2", "-pp2-gpipe")]
        same = cfg.pp == 1  # no pipeline: the schedule is not what it measures
        assert (other.trial_id == cfg.trial_id) is same, name
        assert other.schedule is (PipelineSchedule.one_f_one_b if same else PipelineSchedule.gpipe)
    fewer = _configs(last_stage_fewer_layers=2, world_size=2, pp=2)
    (cfg,) = fewer.values()
    assert cfg.stage_layers == [3, 1] and cfg.trial_id != plain[cfg.run_name].trial_id


def test_schedule_shows_in_the_name_when_not_the_default():
    cfg = _only(world_size=2, pp=2, global_batch=4, schedule="interleaved_1f1b",
                virtual_stages=2).config
    assert trial_name(cfg) == "ws2-tp1-pp2-interleaved_1f1bv2-z0-mb1-ga4"
    assert trial_name(cfg.config_fields()) == trial_name(cfg)  # from a ledger row too


def test_gpu_check_plans_a_pipeline_trial():
    """`make gpu-check` runs it on a machine of two GPUs or more (calibrate/gpucheck.py)."""
    from scalestudy.calibrate import gpucheck
    from scalestudy.spec.load import load_spec

    (p,) = plan_study(load_spec(gpucheck.SPEC, gpucheck.pipeline_overrides("h100-80gb")))
    assert p.feasible, p.reason
    assert (p.config.pp, p.config.world_size, p.config.grad_accum, p.config.zero_stage) == (2, 2, 4, 1)
    assert p.config.stage_layers == [11, 11]
    assert gpucheck.predicted_tokens_per_s(gpucheck.pipeline_overrides("h100-80gb")) > 0
