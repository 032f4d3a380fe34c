"""The plan's uncertainty bands (plan/space.py FAMILY_ERROR) are the validation's own errors per
layout family: recomputed here from the leave-one-source-out scoring, so a band cannot drift from
what the model actually achieves on published rows."""

from __future__ import annotations

from collections import defaultdict

import pytest

from scalestudy.plan.space import FAMILY_ERROR, MIN_FAMILY_ROWS, OVERALL_ERROR, family_of
from tests.validation.test_published import _scored


def test_plan_bands_are_the_validation_errors_per_family():
    errors: dict[str, list[float]] = defaultdict(list)
    for s in _scored():
        if s.predicted is not None:
            c = s.row.cfg
            errors[family_of(c.tp, c.pp, c.zero_stage)].append(abs(s.error))
    every = [e for v in errors.values() for e in v]
    assert OVERALL_ERROR == pytest.approx(sum(every) / len(every), abs=0.005)
    measured = {f: sum(v) / len(v) for f, v in errors.items() if len(v) >= MIN_FAMILY_ROWS}
    assert set(measured) == set(FAMILY_ERROR)
    for family, err in measured.items():
        assert FAMILY_ERROR[family] == pytest.approx(err, abs=0.005), family
