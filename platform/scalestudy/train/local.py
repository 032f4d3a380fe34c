"""The torchrun adapter of the trial body: one trial with no Ray at all.

    torchrun --standalone --nproc_per_node 2 -m scalestudy.train.local SPEC [--set KEY=VALUE ...] [--json]

Every process validates the spec (exactly one trial, as `scalestudy run` takes), starts
torch.distributed from torchrun's environment and runs the same body as a Ray Train worker
(train/body.py); rank 0 prints the same TrialResult as `scalestudy run` (JSON with --json, else a
short table). Without torchrun it runs a world-size-1 trial in this process. For GPU checks and
debugging: a debugger, py-spy or NCCL_DEBUG see one plain process per rank.

Bad input exits 2 with one line (rank 0's) before any process group starts; a failed trial prints its
result with status `failed` and exits 1. Only the results go to stdout: everything else the processes
write there (DeepSpeed's log lines, library prints) is sent to stderr, so `--json` output parses.
Fault tolerance: with --checkpoint-dir (a folder or an object-store URI), checkpoints are written
there and a restarted attempt (`torchrun --max-restarts N`), or a later run given the same place,
resumes from the latest; an elastic spec may resume at another world size (`--nproc_per_node`).
Give every trial a fresh place unless it is meant to resume.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from scalestudy import metrics as M
from scalestudy.errors import SpecError
from scalestudy.metrics import Status, TrialResult
from scalestudy.spec.trial import TrialConfig, trial_name
from scalestudy.train.checkpoint_store import StoredCheckpoint

if TYPE_CHECKING:
    from scalestudy.train.summary import TrialSummary

TABLE_COLUMNS = ("trial_id", "status", M.STEP_TIME_S, M.TOKENS_PER_S, M.TOKENS_PER_S_PER_DEVICE,
                 M.MFU, M.PEAK_MEMORY_GIB, M.LOSS_FIRST, M.LOSS_LAST, "reason")


class LocalReporter:
    """The body's Reporter (train/body.py) under torchrun: checkpoints under a folder or an object
    store URI (`--checkpoint-dir s3://bucket/prefix`) that every rank reaches, the summary
    returned by the body. A save goes to `step-NNNNNNNN/` (each rank uploads its own files); once
    all have, rank 0 points `latest` at it and removes the step before the previous one."""

    def __init__(self, local_rank: int, checkpoint_dir: str | None = None):
        self.local_rank = local_rank
        self.keeps_checkpoints = checkpoint_dir is not None
        self.fs, self.root = _filesystem(checkpoint_dir) if checkpoint_dir else (None, "")

    def save_checkpoint(self, directory: str, step: int) -> None:
        import pyarrow.fs
        import torch.distributed as dist

        name = f"step-{step:08d}"
        pyarrow.fs.copy_files(directory, f"{self.root}/{name}",
                              destination_filesystem=self.fs)
        dist.barrier()
        if dist.get_rank() == 0:
            previous = self._latest()
            with self.fs.open_output_stream(f"{self.root}/{LATEST}") as f:
                f.write(name.encode())
            for info in self.fs.get_file_info(pyarrow.fs.FileSelector(self.root)):
                old = info.base_name
                if old.startswith("step-") and old not in (name, previous):
                    self.fs.delete_dir(info.path)
        dist.barrier()

    def _latest(self) -> str | None:
        import pyarrow.fs

        path = f"{self.root}/{LATEST}"
        if self.fs.get_file_info(path).type != pyarrow.fs.FileType.File:
            return None
        with self.fs.open_input_stream(path) as f:
            return f.read().decode().strip()

    @contextmanager
    def latest_checkpoint(self) -> Iterator[StoredCheckpoint | None]:
        name = self._latest() if self.fs is not None else None
        yield None if name is None else StoredCheckpoint(self.fs, f"{self.root}/{name}")

    def report_summary(self, summary: TrialSummary | None) -> None:
        """Nothing to send: the body returns rank 0's summary to this process."""


LATEST = "latest"


def _filesystem(where: str):
    """(pyarrow file system, path on it) of a folder or a URI (s3://, gs://, file://)."""
    import pyarrow.fs

    if "://" in where:
        fs, path = pyarrow.fs.FileSystem.from_uri(where)
    else:
        fs, path = pyarrow.fs.LocalFileSystem(), str(Path(where).resolve())
    fs.create_dir(path, recursive=True)
    return fs, path.rstrip("/")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scalestudy.train.local", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", type=Path, help="study spec YAML (one trial, after --set)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec key (VALUE is YAML); repeatable")
    p.add_argument("--json", action="store_true", help="print the TrialResult as JSON")
    p.add_argument("--checkpoint-dir", default=None,
                   help="folder or URI (s3://...) where fault-tolerance checkpoints go and a "
                        "restarted or repeated run resumes from")
    p.add_argument("--no-instrument", action="store_true",
                   help="no energy meter and no profiled window")
    return p.parse_args(argv)


def one_trial(spec: Path, overrides: list[str], world_size: int) -> TrialConfig:
    """The single runnable trial of the spec, for a world of `world_size` processes."""
    from scalestudy.spec.load import load_spec
    from scalestudy.plan import plan_study

    planned = plan_study(load_spec(spec, overrides))
    if len(planned) != 1:
        raise SpecError("spec", f"{len(planned)} trials",
                        "the local adapter takes exactly one trial; pick one with --set, e.g. "
                        "--set world_size=2 --set zero_stage=3")
    cfg = planned[0].config
    el = cfg.elastic
    if el is None and world_size != cfg.world_size:
        raise SpecError("world_size", cfg.world_size,
                        f"the trial needs {cfg.world_size} processes and {world_size} were started; "
                        f"run it with torchrun --nproc_per_node {cfg.world_size}")
    if el is not None and not el.min_workers <= world_size <= el.max_workers:
        raise SpecError("elastic", f"{world_size} processes",
                        f"start between {el.min_workers} and {el.max_workers} processes")
    return cfg


def _rendezvous_env() -> None:
    """Without torchrun: a world of one process on this host."""
    if "RANK" in os.environ:
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def run_local(cfg: TrialConfig, args: argparse.Namespace, t0: float) -> TrialResult | None:
    """Run the body on this rank; rank 0 gets the TrialResult (failed, with the reason, when the
    trial raised), the other ranks None."""
    from scalestudy.train import timing
    from scalestudy.train.process import init_process_group, prepare_process
    from scalestudy.train.result import failure_reason, summarize

    timing.start()
    timing.mark("worker_entry")
    prepare_process(cfg)
    _rendezvous_env()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    try:
        init_process_group(cfg, local_rank)
        from scalestudy.train.body import run_body

        reporter = LocalReporter(local_rank, args.checkpoint_dir)
        summary = run_body(cfg, reporter, instrument=not args.no_instrument)
        return summarize(cfg, summary, t0) if rank == 0 else None
    except Exception as err:  # noqa: BLE001 - a failing trial is a recorded outcome
        if rank != 0:
            raise
        return TrialResult.from_config(cfg, Status.failed, reason=failure_reason(err),
                                       wall_time_s=time.time() - t0)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _table(result: TrialResult) -> str:
    """A short table of the result, as `scalestudy run` prints without --json."""
    row = result.model_dump(mode="json")
    width = max(len(c) for c in TABLE_COLUMNS)
    lines = [f"{result.study}: {trial_name(result)}"]
    for col in TABLE_COLUMNS:
        value = row.get(col)
        text = f"{value:.4g}" if isinstance(value, float) else ("" if value is None else str(value))
        lines.append(f"  {col:<{width}}  {text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    t0 = time.time()
    args = _parse(argv)
    rank = int(os.environ.get("RANK", "0"))
    # Results only on the real stdout: whatever else writes to fd 1 (DeepSpeed's logger, gloo)
    # goes to stderr from here on.
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        cfg = one_trial(args.spec, args.overrides, int(os.environ.get("WORLD_SIZE", "1")))
    except SpecError as err:
        if rank == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    result = run_local(cfg, args, t0)
    if result is None:
        return 0
    results.write(result.model_dump_json() + "\n" if args.json else _table(result) + "\n")
    results.flush()
    return 0 if result.status is Status.completed else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without Python's finalisation: a process that used torch.profiler (the profiled window)
    # can abort at interpreter exit ("terminate called without an active exception": a C++ thread
    # that calls back into Python is unwound while the interpreter shuts down; kineto issue #1051,
    # pytorch PR #195837), turning a finished trial into a failed torchrun. Everything is written
    # and the process group is destroyed by now. Ray's workers do not exit between trials.
    os._exit(code)
