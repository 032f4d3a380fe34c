"""The `workers` spec option and warm-group rank placement (no Ray cluster needed)."""

from __future__ import annotations

import pytest

from scalestudy.errors import SpecError
from scalestudy.spec.load import load_spec
from scalestudy.sweep.driver import spec_hash
from scalestudy.launch.warm import _rank_env, pool_name
from tests.conftest import QUICKSTART


def test_reuse_is_on_by_default_and_off_on_request():
    assert load_spec(QUICKSTART).workers.reuse is True
    assert load_spec(QUICKSTART, ["workers={reuse: false}"]).workers.reuse is False
    assert pool_name(False, "abc") is None and pool_name(True, "abc").endswith("abc")


def test_unknown_workers_key_is_refused():
    with pytest.raises(SpecError):
        load_spec(QUICKSTART, ["workers={reuse: false, warm: 3}"])


def test_spec_hash_ignores_how_workers_start():
    """Existing studies keep their spec hash: reuse does not change what a trial measures."""
    on, off = load_spec(QUICKSTART), load_spec(QUICKSTART, ["workers={reuse: false}"])
    assert spec_hash(on) == spec_hash(off)
    assert "workers" not in on.model_dump_json()


def test_ranks_are_contiguous_per_node_and_gpus_follow_local_rank():
    placed = [("n2", "10.0.0.2", ["3"]), ("n1", "10.0.0.1", ["1"]), ("n2", "10.0.0.2", ["1"]),
              ("n1", "10.0.0.1", ["0"])]
    envs = _rank_env(placed)
    assert [e["RANK"] for e in envs] == ["1", "3", "0", "2"]
    assert [e["LOCAL_RANK"] for e in envs] == ["1", "1", "0", "0"]
    assert envs[0]["CUDA_VISIBLE_DEVICES"] == "1,3" and envs[3]["CUDA_VISIBLE_DEVICES"] == "0,1"
    cpu = _rank_env([("n1", "ip", []), ("n1", "ip", [])])
    assert [e["RANK"] for e in cpu] == ["0", "1"] and "CUDA_VISIBLE_DEVICES" not in cpu[0]


def test_warm_group_asks_what_a_cold_trial_asks():
    """A warm group's bundles are a cold trial's: the profile's device, its CPUs and its
    accelerator type as Ray Train's own constraint resource (so a mixed cluster keeps an A100
    trial off H100 nodes on both paths)."""
    from ray._common.utils import RESOURCE_CONSTRAINT_PREFIX
    from ray.air.config import ScalingConfig

    from scalestudy.plan import plan_study
    from scalestudy.launch.placement import placement_for
    from scalestudy.launch.warm import resources_per_worker

    cfg = plan_study(load_spec(QUICKSTART, ["hardware=a100-80gb"]))[0].config
    placement = placement_for(cfg)
    cold = ScalingConfig(num_workers=cfg.world_size, use_gpu=placement.use_gpu,
                         resources_per_worker=placement.resources_per_worker,
                         accelerator_type=placement.accelerator_type)._resources_per_worker_not_none
    assert resources_per_worker(cfg) == cold
    assert f"{RESOURCE_CONSTRAINT_PREFIX}A100-80G" in cold
