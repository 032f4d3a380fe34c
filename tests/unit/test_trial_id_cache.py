"""TrialConfig caches its trial id (a sweep and the model ask for it many times); a copy with another
field must never carry the cached id of the config it was copied from."""

from __future__ import annotations

import pickle

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
