"""No DeepSpeed timer synchronizes the device inside a trial's timed window: the config a trial
builds turns the engine's throughput timer off (DeepSpeed's default turns it on, synchronized), and
the breakdown timers with it. Driven through DeepSpeed's own config parser and timer class, with the
accelerator's synchronize counted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from scalestudy.parallel.deepspeed_config import deepspeed_config
from tests.conftest import trial


def _syncs_in_steps(ds_config: dict, monkeypatch, steps: int = 6, micro_batches: int = 2) -> int:
    """Device synchronizations DeepSpeed's throughput timer makes over `steps` optimizer steps, as
    the engine drives it (start at each forward, stop after each micro-batch's step)."""
    import deepspeed.utils.timer as ds_timer
    from deepspeed.utils.config import get_timers_config

    calls = []
    monkeypatch.setattr(ds_timer, "get_accelerator",
                        lambda: SimpleNamespace(synchronize=lambda: calls.append(1)))
    timer = ds_timer.ThroughputTimer(get_timers_config(ds_config), batch_size=1)
    for _ in range(steps):
        for k in range(micro_batches):
            timer.start()
            timer.stop(global_step=k == micro_batches - 1, report_speed=False)
    return len(calls)


@pytest.mark.parametrize("hardware", ["cpu-local", "h100-80gb"])
def test_trial_config_turns_every_deepspeed_timer_off(hardware, monkeypatch):
    from deepspeed.runtime.config import get_wall_clock_breakdown
    from deepspeed.utils.config import get_timers_config

    ds = deepspeed_config(trial(["zero_stage=3", "world_size=1", f"hardware={hardware}"]))
    timers = get_timers_config(ds)
    assert timers.enabled is False and timers.synchronized is False
    assert get_wall_clock_breakdown(ds) is False
    assert _syncs_in_steps(ds, monkeypatch) == 0


def test_deepspeeds_default_would_synchronize_in_every_step(monkeypatch):
    """What the setting prevents (and proof the count above can fail): without it, DeepSpeed's
    throughput timer syncs the device at each micro-batch's start and end once past its start step."""
    ds = deepspeed_config(trial(["zero_stage=0", "world_size=1"]))
    del ds["timers"]
    assert _syncs_in_steps(ds, monkeypatch, steps=6, micro_batches=2) > 6
