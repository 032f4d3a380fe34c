"""The memory estimate (perfmodel/memory.py) against measured peaks of real CPU trials (issue 30).

The measured table is tests/validation/data/memory_measured.yaml, written by
tests/validation/measure_memory.py (its `measured` block: the command, the date, `lscpu`'s model): 15
trials of a 52M-parameter Llama in fp32 and bf16 (memory_spec.yaml) over ZeRO 0-3, tp 1-2,
micro-batches 1-8 and activation checkpointing, each in a process group of its own (torchrun, no
Ray), measured as the platform records memory on a CPU: the largest rank's peak RSS.

* test_estimate_within_bound_of_every_scored_trial: the estimate of each scored trial is within
  BOUND of its recorded peak. None of the estimate's constants was chosen on these trials: the
  worker process (CPU_PROCESS_BYTES) comes from the llama2-tiny trials of the `process` group, the
  heap's retained memory (CPU_HEAP_RETAINED_BYTES) from another model's trials (`calibration`); a
  test below recomputes both from those groups and checks the constants agree.
* test_live_trials_reproduce_the_table (slow): all 12+ trials take about 15 minutes on this 2-core
  machine, more than the suite can spend, so a representative subset (LIVE: ZeRO 0 and 3, tp 2,
  checkpointing) is measured again here, one after another, and held both to the estimate (BOUND)
  and to the recorded figure (REPRODUCE, wide enough for another CPU's heap), which shows the table
  is this code's measurement.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
import measure_memory as mm  # noqa: E402  (the script that writes the table)

from scalestudy.perfmodel import memory  # noqa: E402

BOUND = 0.15
# The recorded figure against a live one. On the machine kind that recorded the table a trial's
# peak RSS repeats within ~5% (AMD EPYC, 2026-12-07: z0-w2-mb4 1.654, 1.665, 1.684, 1.666 GiB
# against 1.681; tp2-z3-w2-mb2 -4.7% in one run); on CI's machine at stop 40, z0-w2-mb4 came back
# 6.3% higher (1.787 GiB): the heap's and the math libraries' share of a CPU process is not the
# same on every CPU. The bound covers both; the estimate's bound (BOUND) is held against the live
# figure on whatever machine runs the test.
REPRODUCE = 0.10
LIVE = ("z0-w1-mb1", "tp2-z3-w2-mb2", "z3-w2-mb1-ckpt", "z0-w2-mb4")
KNOWN_MISS_BOUND = 2 * BOUND  # a recorded known miss (its `known_miss` says why) may not drift further
DATA = yaml.safe_load(mm.DATA.read_text())


def _group(name: str) -> tuple[Path, list[dict]]:
    group = DATA["groups"][name]
    return mm.spec_of(group), group["trials"]


def _table() -> list[tuple[dict, object]]:
    spec, trials = _group("scored")
    return [(t, mm.estimate(t["set"], spec)) for t in trials]


def _print(rows: list[tuple[dict, object, float]]) -> None:
    terms = [t for t in memory.TERMS if any(est.terms_gib[t] for _, est, _ in rows)]
    print(f"\n{'trial':<16}" + "".join(f"{t[:9]:>10}" for t in terms)
          + f"{'estimate':>10}{'measured':>10}{'error':>8}")
    for trial, est, measured in rows:
        print(f"{trial['id']:<16}" + "".join(f"{est.terms_gib[t]:>10.3f}" for t in terms)
              + f"{est.total_gib:>10.3f}{measured:>10.3f}{est.total_gib / measured - 1:>+8.1%}")


def test_estimate_within_bound_of_every_scored_trial():
    """Every scored trial within BOUND, but those the table records as known misses (with the reason),
    which stay within KNOWN_MISS_BOUND; at least 12 within BOUND, as issue 30 asks."""
    rows = [(t, est, t["peak_memory_gib"]) for t, est in _table()]
    _print(rows)
    meta = DATA["measured"]
    print(f"measured {meta['date']} on '{meta['cpu_model']}' by {meta['command']}")
    errors = {t["id"]: est.total_gib / m - 1 for t, est, m in rows}
    known = {t["id"]: t["known_miss"] for t, _, _ in rows if t.get("known_miss")}
    print(f"MAPE {sum(abs(e) for e in errors.values()) / len(errors):.1%} over {len(errors)} trials; "
          f"known misses: {known}")
    misses = {i: round(e, 3) for i, e in errors.items() if abs(e) > BOUND and i not in known}
    assert not misses, f"beyond {BOUND:.0%}: {misses}"
    assert all(abs(errors[i]) <= KNOWN_MISS_BOUND for i in known), {i: errors[i] for i in known}
    assert sum(abs(e) <= BOUND for e in errors.values()) >= 12


def test_cpu_constants_come_from_the_trials_that_are_not_scored():
    """CPU_PROCESS_BYTES: the llama2-tiny trials' peaks less their (few MiB of) tensors;
    CPU_HEAP_RETAINED_BYTES: on the calibration model, the peak less the process and the estimated
    tensors, averaged. Both within rounding of the module's constants."""
    def tensors(est) -> float:
        t = est.terms_gib
        return est.total_gib - t["runtime"] - t["fragmentation"]

    spec, trials = _group("process")
    process = [t["peak_memory_gib"] - tensors(mm.estimate(t["set"], spec)) for t in trials]
    spec, trials = _group("calibration")
    proc = memory.CPU_PROCESS_BYTES / memory.GIB
    retained = [t["peak_memory_gib"] - proc - tensors(mm.estimate(t["set"], spec)) for t in trials]
    print(f"\nprocess per llama2-tiny trial {[round(p, 3) for p in process]} GiB; heap retained per "
          f"calibration trial {[round(r, 3) for r in retained]} GiB")
    assert sum(process) / len(process) == pytest.approx(proc, abs=0.015)
    assert sum(retained) / len(retained) == pytest.approx(
        memory.CPU_HEAP_RETAINED_BYTES / memory.GIB, abs=0.015)


def test_the_table_spans_what_the_issue_asks():
    sets = [" ".join(t["set"]) for t in _group("scored")[1]]
    for needed in ("zero_stage=0", "zero_stage=1", "zero_stage=2", "zero_stage=3", "tp=2",
                   "activation_checkpointing=true", "activation_checkpointing=selective"):
        assert any(needed in s for s in sets), needed
    assert len({s.split("micro_batch=")[1].split()[0] for s in sets}) >= 3


@pytest.mark.slow
def test_live_trials_reproduce_the_table():
    table = {t["id"]: (t, est) for t, est in _table()}
    sets = " ".join(" ".join(table[i][0]["set"]) for i in LIVE)
    assert "zero_stage=0" in sets and "zero_stage=3" in sets and "tp=2" in sets
    assert "activation_checkpointing=true" in sets
    rows, drift = [], []
    for trial_id in LIVE:
        trial, est = table[trial_id]
        measured = float(mm.run_trial(trial["set"])["peak_memory_gib"])
        rows.append((trial, est, measured))
        drift.append((trial_id, measured / trial["peak_memory_gib"] - 1))
    _print(rows)
    print(f"live on '{mm.cpu_model()}', table from '{DATA['measured']['cpu_model']}'")
    print("against the table: " + ", ".join(f"{i} {d:+.1%}" for i, d in drift))
    assert all(abs(d) <= REPRODUCE for _, d in drift), drift
    assert all(abs(est.total_gib / m - 1) <= (KNOWN_MISS_BOUND if t.get("known_miss") else BOUND)
               for t, est, m in rows)
