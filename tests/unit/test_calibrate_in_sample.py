"""calibrate/reference_step.in_sample: a calibrated profile's reference steps as it predicts them,
and calibrate's warning when one is not reproduced (a factor stopped at the end of its range)."""

from __future__ import annotations

import pytest

from scalestudy.calibrate.reference_step import REPRODUCED, in_sample, reference_config
from scalestudy.cli_tools import _say_in_sample
from scalestudy.perfmodel.predict import simulate
from scalestudy.spec import catalog


def _profile(off: dict[str, float]):
    """cpu-local with its own predictions of three reference steps recorded as their measurements,
    each scaled by `off` (key -> measured / predicted)."""
    hw = catalog.get_hardware("cpu-local")
    cal = dict(hw.calibration)
    for key, (ws, tp, pp) in {"reference_step_s_fp32_ws1": (1, 1, 1),
                              "reference_step_s_fp32_ws2_tp2": (2, 2, 1),
                              "reference_step_s_fp32_ws2_pp2": (2, 1, 2)}.items():
        cfg = reference_config("fp32", ws, tp=tp, pp=pp).model_copy(update={"hardware_profile": hw})
        cal[key] = simulate(cfg)[0].step_s * off.get(key, 1.0)
    return hw.model_copy(update={"calibration": cal})


def test_reference_steps_replayed_in_sample_and_a_clamped_one_named(capsys):
    rows = in_sample(_profile({}))
    assert len(rows) == 3 and all(r.error == pytest.approx(0.0, abs=1e-9) for r in rows)
    assert {r.name for r in rows} == {"ws1-tp1-z0-mb2-fp32", "ws2-tp2-z0-mb2-fp32",
                                      "ws2-tp1-pp2-z0-mb2-ga4-fp32"}
    slow = in_sample(_profile({"reference_step_s_fp32_ws2_tp2": 1 / (1 + 2 * REPRODUCED)}))
    missed = [r for r in slow if not r.reproduced]
    assert [r.name for r in missed] == ["ws2-tp2-z0-mb2-fp32"] and missed[0].error > REPRODUCED
    _say_in_sample(slow)
    out = capsys.readouterr().out
    assert "in sample" in out and out.count("warning:") == 1 and "ws2-tp2-z0-mb2-fp32" in out
