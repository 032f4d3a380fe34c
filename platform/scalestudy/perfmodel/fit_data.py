"""Measured trials of a study's ledger -> (TrialConfig, measured tokens/s) pairs for scoring and fitting.

A result row carries every config column but not the model's dimensions or the full hardware
profile: spec/trial.py's config_from_row brings those back from the catalogues by name (or from the
profile the caller names), so only catalogue models can be refitted; other rows are skipped. The
caller reads the ledger (the performance model imports no storage layer).
"""

from __future__ import annotations

import math
from pathlib import Path

from scalestudy.metrics import Status, TrialResult
from scalestudy.spec import catalog
from scalestudy.spec.catalog import HardwareProfile
from scalestudy.spec.errors import SpecError
from scalestudy.spec.trial import TrialConfig, config_from_row


def resolve_profile(name_or_path: str) -> HardwareProfile:
    if name_or_path in catalog.hardware_names():
        return catalog.get_hardware(name_or_path)
    path = Path(name_or_path)
    if not path.is_file():
        raise SpecError("--hardware", name_or_path,
                        f"neither a catalogue entry ({', '.join(catalog.hardware_names())}) "
                        "nor a profile file")
    return catalog.profile_from_file(path, "--hardware")


def measured_pairs(results: list[TrialResult], hw: HardwareProfile
                   ) -> tuple[list[TrialConfig], list[float], list[TrialResult]]:
    """Completed, measured trials with a finite throughput, as (configs, tokens/s, results)."""
    cfgs, measured, kept = [], [], []
    for r in results:
        if r.status is not Status.completed or r.backend != "measure":
            continue
        if not math.isfinite(r.tokens_per_s) or r.model not in catalog.model_names():
            continue
        cfgs.append(config_from_row(r, hw))
        measured.append(r.tokens_per_s)
        kept.append(r)
    return cfgs, measured, kept


def measured_trials(results: list[TrialResult], hardware: str | None = None):
    """(configs, measured tokens/s, results, profile) of a study's completed measured trials,
    against `hardware` (catalogue name or profile path; default: the trials' own)."""
    hw = resolve_profile(hardware or results[0].hardware)
    cfgs, measured, kept = measured_pairs(results, hw)
    if not cfgs:
        raise SpecError("STUDY", results[0].study,
                        "the ledger has no completed measured trial to fit")
    return cfgs, measured, kept, hw
