"""The torchrun adapter's front: no Ray anywhere under the trial body, and bad input refused with
one line and exit 2 before any process group starts (the run itself: tests/integration)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import QUICKSTART, REPO

BLOCK_RAY = "import sys\nsys.modules['ray'] = None\n"


def _local(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scalestudy.train.local", *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, **(env or {})})


def test_the_body_and_its_adapter_import_without_ray():
    code = BLOCK_RAY + ("import scalestudy.train.body, scalestudy.train.local, scalestudy.train.result\n"
                        "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_more_than_one_trial_is_refused_in_one_line():
    proc = _local(str(QUICKSTART), "--json")
    assert proc.returncode == 2 and proc.stdout == ""
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "exactly one trial" in lines[0] and "Traceback" not in proc.stderr


def test_bad_value_is_refused_in_one_line():
    proc = _local(str(QUICKSTART), "--set", "zero_stage=7")
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "zero_stage" in lines[0] and "0, 1, 2, 3" in lines[0]


def test_a_world_of_the_wrong_size_is_refused():
    proc = _local(str(QUICKSTART), "--set", "world_size=2", "--set", "zero_stage=0",
                  env={"WORLD_SIZE": "1"})
    assert proc.returncode == 2
    assert "--nproc_per_node 2" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
