"""Which hardware profile speaks for each hardware of a report: the one that predicts its measured
trials and whose peak every MFU of that hardware is relative to.

Order: a profile given explicitly (`scalestudy report --profile`), else the newest calibrated or
fitted profile of that hardware name under the results root, else the catalogue's (uncalibrated)
entry. The report says which one was used and from where, so catalogue figures never pass for a
calibrated model.

Looked for under the results root (newest by modification time wins):
  <root>/calibrated-<hardware>.yaml     what `make demo` and `scalestudy calibrate` write
  <root>/<study>/fitted-<hardware>.yaml  what `scalestudy fit <study>` writes
  <root>/*.yaml, <root>/*/*.yaml         any other profile YAML whose `name` is the hardware
A YAML counts only if it is a hardware profile of that name whose calibration goes beyond the
catalogue's (a GEMM curve from `calibrate`, or parameters from `fit`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import yaml
from pydantic import ValidationError

from scalestudy.spec import catalog
from scalestudy.spec.catalog import HardwareProfile
from scalestudy.track import storage

CATALOGUE, GIVEN, FOUND = "catalogue", "given", "found"


def is_calibrated(hw: HardwareProfile) -> bool:
    """Whether `scalestudy calibrate` measured this profile (a GEMM curve is measured, never
    typed)."""
    return any(k.startswith("gemm_tflops_") for k in hw.calibration)


def is_fitted(hw: HardwareProfile) -> bool:
    """Whether the profile carries calibration the catalogue entry of its name lacks (`fit` adds
    fitted efficiency parameters); a name outside the catalogue counts with any calibration."""
    if is_calibrated(hw):
        return False
    try:
        base = catalog.get_hardware(hw.name).calibration
    except KeyError:
        return bool(hw.calibration)
    return hw.calibration != base


def measured_against(hw: HardwareProfile) -> str:
    """'calibrated (2026-12-04T14:00:00Z)', 'fitted to measured trials' or 'UNCALIBRATED ...'."""
    if is_calibrated(hw):
        return f"calibrated ({hw.description.rsplit('(calibrated', 1)[-1].strip(' )')})"
    if is_fitted(hw):
        return "fitted to measured trials"
    return "UNCALIBRATED catalogue figures"


@dataclass(frozen=True)
class ChosenProfile:
    """The profile of one hardware name and where it came from."""

    hardware: str
    profile: HardwareProfile | None  # None: a name outside the catalogue and no profile found
    how: str  # CATALOGUE | GIVEN | FOUND
    path: Path | None = None
    candidates: int = 0  # profiles of this hardware found under the results root
    searched: bool = True  # False: the results root is no local folder, nothing was looked for
    passed: tuple[str, ...] = ()  # files at the named paths that are no usable profile, and why

    @property
    def label(self) -> str:
        """Short form for figure titles: 'cpu-local, calibrated (...) from results/x.yaml'."""
        if self.profile is None:
            return f"{self.hardware}, no profile (not in the catalogue)"
        text = f"{self.hardware}, {measured_against(self.profile)}"
        return text + (f" from {self.path}" if self.path else "")

    def sentence(self, root: Path | str, predicts: bool = True) -> str:
        """One line for the report's header: which profile set the MFU peak (and predicted the
        measured trials, when `predicts`: predictions already in the ledger keep theirs)."""
        text = self._sentence(root, predicts)
        return "; ".join([text, *self.passed])

    def _sentence(self, root: Path | str, predicts: bool) -> str:
        what = (f"predictions and the MFU peak of {self.hardware} come" if predicts else
                f"the MFU peak of {self.hardware} comes")
        if self.how == GIVEN:
            return f"{what} from the profile given (--profile): {self.label}"
        if self.how == FOUND:
            more = f" (newest of {self.candidates} found)" if self.candidates > 1 else ""
            return f"{what} from {self.path}{more}, {measured_against(self.profile)}"
        looked = (f"looked for calibrated-{self.hardware}.yaml and <study>/fitted-"
                  f"{self.hardware}.yaml under {root}" if self.searched else
                  f"{root} is not a local folder, so no profile was looked for there")
        if self.profile is None:
            return (f"no profile of {self.hardware}: none found ({looked}) and it is not in the "
                    "catalogue, so its MFU stays as recorded and nothing predicts its trials")
        return (f"{what} from the catalogue's UNCALIBRATED figures: no calibrated profile "
                f"of {self.hardware} was used ({looked}); write one with `scalestudy calibrate` "
                "or pass --profile")


def _profile_at(path: Path, hardware: str) -> HardwareProfile | str:
    """The calibrated or fitted profile of `hardware` at path, else why not (one line)."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        return f"unreadable ({str(err).splitlines()[0]})"
    if not isinstance(data, dict) or "peak_tflops" not in data:
        return "not a hardware profile"
    if data.get("name") != hardware:
        return f"a profile of {data.get('name')!r}"
    try:
        hw = HardwareProfile(**data)
    except (TypeError, ValidationError) as err:  # an older or foreign YAML of the same name
        return f"not a valid profile ({str(err).splitlines()[0]})"
    return hw if is_calibrated(hw) or is_fitted(hw) else "no calibration beyond the catalogue's"


def named_paths(root: Path, study: str, hardware: str) -> list[Path]:
    """Where `calibrate` (make demo) and `fit` write a profile of this hardware."""
    return [root / f"calibrated-{hardware}.yaml", root / study / f"fitted-{hardware}.yaml"]


def candidate_paths(root: Path, study: str, hardware: str) -> list[Path]:
    named = named_paths(root, study, hardware)
    others = sorted({*root.glob("*.yaml"), *root.glob("*/*.yaml")} - set(named))
    return [p for p in (*named, *others) if p.is_file()]


def find_profiles(root: Path, study: str, hardware: str
                  ) -> tuple[list[tuple[Path, HardwareProfile]], list[str]]:
    """(calibrated or fitted profiles of `hardware` under root, newest first; why a file at one of
    the named paths was passed over). Other YAMLs that are not such a profile pass silently."""
    found, passed = [], []
    named = named_paths(root, study, hardware)
    for path in candidate_paths(root, study, hardware):
        hw = _profile_at(path, hardware)
        if isinstance(hw, HardwareProfile):
            found.append((path, hw))
        elif path in named:
            passed.append(f"{path} passed over: {hw}")
    return sorted(found, key=lambda f: f[0].stat().st_mtime, reverse=True), passed


def catalogue_choice(name: str, searched: bool = False) -> ChosenProfile:
    """The catalogue's entry of that name (None outside the catalogue)."""
    try:
        base = catalog.get_hardware(name)
    except KeyError:
        base = None
    return ChosenProfile(name, base, CATALOGUE, searched=searched)


def choose_profiles(hardware: Iterable[str], results_root: str | Path, study: str,
                    given: HardwareProfile | None = None) -> dict[str, ChosenProfile]:
    """One ChosenProfile per hardware name (see the module's docstring for the order)."""
    root = storage.as_location(results_root)
    out: dict[str, ChosenProfile] = {}
    for name in sorted(set(hardware)):
        if given is not None and given.name == name:
            out[name] = ChosenProfile(name, given, GIVEN)
            continue
        local = isinstance(root, Path)
        found, passed = find_profiles(root, study, name) if local and root.is_dir() else ([], [])
        if found:
            path, hw = found[0]
            out[name] = ChosenProfile(name, hw, FOUND, path, len(found), passed=tuple(passed))
            continue
        out[name] = replace(catalogue_choice(name, searched=local), passed=tuple(passed))
    return out


__all__ = ["CATALOGUE", "FOUND", "GIVEN", "ChosenProfile", "catalogue_choice", "choose_profiles",
           "find_profiles", "is_calibrated", "is_fitted", "measured_against"]
