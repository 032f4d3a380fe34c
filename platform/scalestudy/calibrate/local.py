"""`scalestudy calibrate --local`: the same benchmarks as calibrate/run.py with no Ray at all.

The device benchmarks and the reference step alone run in this process (a world of one, gloo, one
core, as a trial's rank); the collectives and the reference step on every core at once run in one
plain process per rank, started here the way torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), with the Ray-free set-up every trial process gets (train/process.py, as the torchrun
adapter train/local.py uses). No Ray cluster to start (10-20 s on a loaded 2-core machine) and no
worker group to schedule: what the demo's quick calibration needs to stay under 45 s.

    python -m scalestudy.calibrate.local --worker FOLDER   (one rank; internal)
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from scalestudy.calibrate import reference_step
from scalestudy.calibrate.run import Progress, benchmarks, build_profile, default_precisions
from scalestudy.spec.catalog import HardwareProfile

RANK_TIMEOUT_S = 600.0  # a full calibration's ranks finish in about a minute on 2 cores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_rank(config: dict[str, Any]) -> dict[str, Any]:
    """benchmarks() in a process group of the ranks torchrun-style variables describe; this process
    is one of them. The set-up is a CPU trial's (train/process.py), on the reference shape."""
    from scalestudy.train import reentry
    from scalestudy.train.process import init_process_group, prepare_process

    cfg = reference_step.reference_config(config["precisions"][0], int(os.environ["WORLD_SIZE"]))
    prepare_process(cfg)  # DS_ACCELERATOR=cpu and the trials' allocator behaviour
    import torch
    import torch.distributed as dist

    threads = torch.get_num_threads()
    init_process_group(cfg, int(os.environ.get("LOCAL_RANK", "0")))  # gloo, one thread
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # progress lines, not engine logs
    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecation notes per collective
    # World 1 runs in the caller's process: the engines below leave DeepSpeed's group globals
    # pointing at this process group, and a second calibration in the same process (a test
    # session, a notebook) would broadcast over the destroyed one. Put them back as a trial does.
    clean = reentry.snapshot()
    try:
        return benchmarks(config)
    finally:
        reentry.end_trial(clean)
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def _alone(config: dict[str, Any]) -> dict[str, Any]:
    """World 1 in this process: no process to start, its imports are paid once."""
    saved = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                             "MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    try:
        return _run_rank(config)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _Ranks:
    """`world` rank processes, started before this process's own benchmarks so that their imports
    (torch, DeepSpeed, transformers: 10-15 s on a loaded 2-core machine) overlap this process's;
    each then waits, idle, for the go file: nothing else runs while the world-1 benchmarks time.
    Their engine logs go to a file (shown when a rank fails), rank 0's progress lines to stderr."""

    def __init__(self, world: int, config: dict[str, Any]):
        self.tmp = tempfile.TemporaryDirectory(prefix="scalestudy-calibrate-")
        d = Path(self.tmp.name)
        self.out, self.log, self.go = d / "out.json", d / "log", d / "go"
        (d / "config.json").write_text(json.dumps(config))
        port = str(_free_port())
        self.procs = []
        with open(self.log, "w") as log:
            for rank in range(world):
                env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "scalestudy.calibrate.local", "--worker", str(d)],
                    env=env, stdout=log, stderr=None if rank == 0 else log))

    def wait_ready(self) -> None:
        d = Path(self.tmp.name)
        while not all((d / f"ready{r}").exists() for r in range(len(self.procs))):
            if any(p.poll() is not None for p in self.procs):
                break  # a rank died while importing: run() reports it
            time.sleep(0.05)

    def run(self) -> dict[str, Any]:
        self.go.touch()
        codes = [_wait(p) for p in self.procs]
        try:
            if any(codes) or not self.out.exists():
                tail = self.log.read_text()[-3000:]
                raise RuntimeError(f"calibration ranks exited with {codes}; their log ends:\n{tail}")
            return json.loads(self.out.read_text())
        finally:
            self.tmp.cleanup()

    def stop(self) -> None:
        for p in self.procs:  # only the ranks started above
            if p.poll() is None:
                p.kill()
                p.wait()
        self.tmp.cleanup()


def _wait(proc: subprocess.Popen) -> int:
    try:
        return proc.wait(timeout=RANK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()  # this rank's own process, started above
        return proc.wait()


def calibrate_local(base: HardwareProfile, quick: bool = False, precisions: list[str] | None = None,
                    max_world: int = 2) -> HardwareProfile:
    """calibrate/run.py's calibrate() without Ray: the world-1 benchmarks here, then min(max_world,
    cores) ranks for the collectives and the shared reference step."""
    if base.is_gpu:  # this machine's GPUs, one process per GPU (no Ray either)
        from scalestudy.calibrate.gpu import calibrate_local_gpus

        return calibrate_local_gpus(base, quick=quick)
    config = {"quick": quick, "precisions": precisions or default_precisions(base)}
    world = min(max_world, len(os.sched_getaffinity(0)))
    ranks = _Ranks(world, config) if world >= 2 else None
    say = Progress(True, "local")
    try:
        say("imports (torch, DeepSpeed, transformers)", _import_all)
        if ranks:
            say(f"{world} rank processes started and imported", ranks.wait_ready)
        alone = say("world-1 benchmarks", lambda: _alone(config))
        shared = say(f"world-{world} benchmarks", ranks.run) if ranks else None
    except BaseException:
        if ranks:
            ranks.stop()
        raise
    return build_profile(base, alone, shared)


def _import_all() -> None:
    """What the benchmarks import, imported now (while no benchmark times)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # noqa: F401
    import transformers  # noqa: F401
    from transformers import LlamaForCausalLM, OPTForCausalLM  # noqa: F401


def _worker_main(folder: str) -> int:
    d = Path(folder)
    _import_all()
    rank = int(os.environ["RANK"])
    (d / f"ready{rank}").touch()
    while not (d / "go").exists():
        time.sleep(0.05)
    res = _run_rank(json.loads((d / "config.json").read_text()))
    if rank == 0:
        (d / "out.json").write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--worker":
        sys.exit(__doc__)
    sys.stdout.flush()
    # Without Python's finalisation, as train/local.py leaves: everything is written by now.
    os._exit(_worker_main(sys.argv[2]))
