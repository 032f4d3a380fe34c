"""TrialConfig caches its trial id (a sweep and the model ask for it many times); a copy with another
field must never carry the cached id of the config it was copied from."""

from __future__ import annotations

import hashlib
import json
import pickle

from scalestudy.spec import catalog, trial
from scalestudy.spec.trial import Elastic
from tests.validation.test_invariants import random_configs


def test_a_copy_recomputes_the_cached_trial_id():
    cfg = next(iter(random_configs(1, seed=7)))
    first = cfg.trial_id
    changed = cfg.model_copy(update={"seed": cfg.seed + 1})
    assert changed.trial_id != first
    assert changed.model_copy(update={"seed": cfg.seed}).trial_id == first
    assert cfg.model_copy().trial_id == first
    assert pickle.loads(pickle.dumps(cfg)).trial_id == first
    assert "trial_id" not in cfg.model_dump()  # the cache is not a field
    assert cfg == cfg.model_copy()


def _id_from_whole_payload(cfg) -> str:
    """The trial id as it was always computed: sha1 of the whole payload's sorted JSON, the profile
    dumped with the config (trial_id now splices the profile's cached JSON in instead)."""
    payload = cfg.model_dump(mode="json", exclude=set(trial._NOT_HASHED))
    if cfg.elastic is None:
        payload.pop("elastic")
    for name in catalog.PLACEMENT_FIELDS:
        payload["hardware_profile"].pop(name)
    return hashlib.sha1(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def test_trial_ids_are_the_hash_of_the_whole_payload_as_before():
    configs = list(random_configs(40, seed=11))
    curved = configs[0].hardware_profile.model_copy(update={"calibration": {
        "gemm_efficiency": 0.7, "busbw_gbps_all_reduce": [[1048576.0, 80.5], [1e9, 180.0]]}})
    configs.append(configs[0].model_copy(update={"hardware_profile": curved}))
    configs.append(configs[1].model_copy(update={"elastic": Elastic(min_workers=2, max_workers=8)}))
    for cfg in configs:
        assert cfg.trial_id == _id_from_whole_payload(cfg)
    assert len({c.trial_id for c in configs}) == len(configs)
    # a payload that holds the splice's placeholder itself is dumped whole, to the same bytes
    payload = {"a": trial._SPLICE, "z": [1, 2.5]}
    assert trial._sorted_json_with(payload, "m", '{"k": 1}') == json.dumps(
        {**payload, "m": {"k": 1}}, sort_keys=True)


def test_a_copied_profile_recomputes_its_identity_json():
    hw = catalog.get_hardware("a100-80gb")
    assert hw is catalog.get_hardware("a100-80gb")  # one shared object per catalogue name
    before = hw.identity_json
    faster = hw.model_copy(update={"network_gbps_per_gpu": hw.network_gbps_per_gpu * 2})
    assert faster.identity_json != before and hw.identity_json == before
    moved = hw.model_copy(update={"accelerator_type": "A100-80G", "cpus_per_device": 4.0})
    assert moved.identity_json == before  # where a trial runs is not what it measures
    assert hw == hw.model_copy() and "identity_json" not in hw.model_dump()
