"""Measured trials of a study's ledger -> (TrialConfig, measured tokens/s) pairs for scoring and fitting.

A result row carries every config column but not the model's dimensions or the full hardware
profile: those come back from the catalogues by name (or from the profile the caller names), so only
catalogue models can be refitted; other rows are skipped with their names reported.
"""

from __future__ import annotations

import math
from pathlib import Path

from scalestudy.metrics import Status, TrialResult
from scalestudy.spec import catalog
from scalestudy.spec.catalog import HardwareProfile
from scalestudy.spec.errors import SpecError
from scalestudy.spec.study import Steps, TrialConfig


def config_from_result(r: TrialResult, hw: HardwareProfile) -> TrialConfig:
    """Rebuild the TrialConfig a result was produced from (catalogue model, given profile)."""
    if r.model not in catalog.model_names():
        raise SpecError("model", r.model, "only catalogue models can be rebuilt from a ledger row")
    fields = {k: getattr(r, k) for k in TrialConfig.model_fields if hasattr(r, k)}
    fields.update(
        hardware=hw.name, hardware_profile=hw, model_dims=catalog.get_model(r.model),
        steps=Steps(warmup=r.steps_warmup, measure=r.steps_measure, profile=r.steps_profile),
    )
    return TrialConfig(**fields)


def resolve_profile(name_or_path: str) -> HardwareProfile:
    if name_or_path in catalog.hardware_names():
        return catalog.get_hardware(name_or_path)
    path = Path(name_or_path)
    if not path.is_file():
        raise SpecError("--hardware", name_or_path,
                        f"neither a catalogue entry ({', '.join(catalog.hardware_names())}) "
                        "nor a profile file")
    return catalog.load_hardware_file(path)


def measured_pairs(results: list[TrialResult], hw: HardwareProfile
                   ) -> tuple[list[TrialConfig], list[float], list[TrialResult]]:
    """Completed, measured trials with a finite throughput, as (configs, tokens/s, results)."""
    cfgs, measured, kept = [], [], []
    for r in results:
        if r.status is not Status.completed or r.backend != "measure":
            continue
        if not math.isfinite(r.tokens_per_s) or r.model not in catalog.model_names():
            continue
        cfgs.append(config_from_result(r, hw))
        measured.append(r.tokens_per_s)
        kept.append(r)
    return cfgs, measured, kept


def measured_trials(study: str, root: Path, hardware: str | None):
    """(configs, measured tokens/s, results, profile) of a study's completed measured trials."""
    from scalestudy.track.ledger import Ledger, ledger_path

    path = ledger_path(study, root)
    results = Ledger(path).results()
    if not results:
        raise SpecError("STUDY", study, f"no ledger at {path}; run `scalestudy sweep` first")
    hw = resolve_profile(hardware or results[0].hardware)
    cfgs, measured, kept = measured_pairs(results, hw)
    if not cfgs:
        raise SpecError("STUDY", study, "the ledger has no completed measured trial to fit")
    return cfgs, measured, kept, hw
