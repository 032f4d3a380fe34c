"""RAPL energy counters under /sys/class/powercap (Intel, and AMD since Zen): the domains to read and
the wrap-around arithmetic. The meter built on them is ``measure.energy.RaplMeter``."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

POWERCAP_ROOT = "/sys/class/powercap"


def counter_delta(start: int, end: int, max_range: int) -> int:
    """Difference of a wrapping counter that runs 0..max_range (inclusive), assuming <= one wrap."""
    return end - start if end >= start else end + max_range + 1 - start


@dataclass
class RaplDomain:
    name: str  # e.g. "package-0", "package-0/dram"
    path: str
    max_range_uj: int

    def read_uj(self) -> int:
        with open(os.path.join(self.path, "energy_uj")) as f:
            return int(f.read())


def rapl_domains(root: str = POWERCAP_ROOT) -> list[RaplDomain]:
    """Package domains and their dram subdomains. Core/uncore subdomains are inside the package and
    psys (platform) overlaps it, so they are skipped to avoid counting energy twice."""
    out = []
    for pkg in sorted(glob.glob(os.path.join(root, "intel-rapl:[0-9]*"))):
        if os.path.basename(pkg).count(":") != 1:
            continue  # subdomain listed at top level as a symlink
        name = _read(pkg, "name")
        if name is None or not name.startswith("package"):
            continue
        out.append(RaplDomain(name, pkg, int(_read(pkg, "max_energy_range_uj") or 0)))
        for sub in sorted(glob.glob(os.path.join(pkg, os.path.basename(pkg) + ":*"))):
            if _read(sub, "name") == "dram":
                out.append(RaplDomain(f"{name}/dram", sub, int(_read(sub, "max_energy_range_uj") or 0)))
    return out


def _read(path: str, leaf: str) -> str | None:
    try:
        with open(os.path.join(path, leaf)) as f:
            return f.read().strip()
    except OSError:
        return None
