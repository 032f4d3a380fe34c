"""A Ray head of a test's own: `ray start --head --block` on this machine with a private temp dir
and free ports (dashboard and job API on 127.0.0.1 only), in its own process group, stopped by killing that group (never `ray stop`, which would
take down every Ray on the machine, the test session's included)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BIN = Path(sys.executable).parent
AUTOSCALING_FILE = "autoscaling.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Head:
    gcs_address: str
    dashboard_url: str
    temp_dir: Path
    env: dict[str, str]


def _alive_nodes(gcs: str, env: dict[str, str]) -> int:
    code = ("import ray; ray.init(address=%r, logging_level='ERROR', log_to_driver=False); "
            "print('ALIVE', sum(n['Alive'] for n in ray.nodes()))" % gcs)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    alive = [ln.split()[1] for ln in out.stdout.splitlines() if ln.startswith("ALIVE ")]
    return int(alive[-1]) if out.returncode == 0 and alive else 0


@contextlib.contextmanager
def local_head(num_cpus: int, dashboard: bool = False, autoscaling: dict | None = None):
    """Yield a running Head; everything it started is killed on exit, also when the test fails."""
    from ray._private.services import get_node_ip_address

    temp_dir = Path(tempfile.mkdtemp(prefix="rh", dir="/tmp"))  # short: Ray's socket paths are capped
    port, dash = free_port(), free_port()
    # Ray advertises the machine's own address even when told 127.0.0.1 (and then refuses drivers
    # that dial 127.0.0.1), so the head takes that address; the dashboard stays on loopback.
    gcs = f"{get_node_ip_address()}:{port}"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    # A throwaway cluster reachable only from this machine: token auth would make every client find
    # the token the head minted in ~/.ray, which a concurrent Ray session may rewrite.
    env["RAY_AUTH_MODE"] = "disabled"
    cmd = [str(BIN / "ray"), "start", "--head", "--block",
           f"--port={port}", f"--temp-dir={temp_dir}", f"--num-cpus={num_cpus}",
           f"--include-dashboard={'true' if dashboard else 'false'}",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--disable-usage-stats",
           # The job server submits through the head's dashboard agent, whose HTTP port is fixed at
           # 52365 by default. Another Ray session on this machine (the suite's own) holds it, and
           # then the agent stays up without HTTP and never registers: every `ray job submit` gets
           # "No available agent" (ray/dashboard/agent.py). A free port of its own avoids that.
           f"--dashboard-agent-listen-port={free_port()}"]
    if autoscaling is not None:
        # What ray.cluster_utils.AutoscalingCluster does, minus its global `ray stop --force`.
        config = temp_dir / AUTOSCALING_FILE
        config.write_text(json.dumps(fake_autoscaling_config(autoscaling, num_cpus, gcs)))
        cmd.append(f"--autoscaling-config={config}")
        env.update({"AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_FAKE_CLUSTER": "1"})
    log = open(temp_dir / "ray-start.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.time() + 120
        while _alive_nodes(gcs, env) < 1:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"ray head did not start: {(temp_dir / 'ray-start.log').read_text()[-2000:]}")
            time.sleep(1)
        yield Head(gcs, f"http://127.0.0.1:{dash}", temp_dir, {**env, "RAY_ADDRESS": gcs})
    finally:
        _kill_group(proc, TEARDOWN_GRACE_S)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def fake_autoscaling_config(worker_types: dict, head_cpus: int, gcs: str) -> dict:
    """Ray's fake multi-node provider: worker 'nodes' are extra raylets on this machine."""
    return {
        "cluster_name": "scalestudy-fake", "max_workers": sum(
            t["max_workers"] for t in worker_types.values()),
        "idle_timeout_minutes": 10, "upscaling_speed": 1.0,
        "provider": {"type": "fake_multinode", "gcs_address": gcs,
                     "disable_launch_config_check": True, "disable_node_updaters": True},
        "auth": {"ssh_user": "ubuntu"},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": head_cpus}, "node_config": {},
                                 "max_workers": 0},
            **worker_types},
        "head_node_type": "ray.head.default",
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [],
        "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [],
        "head_start_ray_commands": [], "worker_start_ray_commands": [],
    }


def set_node_types(head: Head, worker_types: dict, head_cpus: int) -> None:
    """Change what the autoscaler may launch: it re-reads its config file on every update."""
    config = fake_autoscaling_config(worker_types, head_cpus, head.gcs_address)
    (head.temp_dir / AUTOSCALING_FILE).write_text(json.dumps(config))


# A test's end: nothing of the cluster is kept, so SIGTERM's graceful shutdown buys nothing; `ray
# start --block` often sat out a 30 s grace here (about 90 s of `make test`, 2026-12-04).
TEARDOWN_GRACE_S = 3.0


def _kill_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to the group, `grace_s` to exit, then SIGKILL to whatever is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    # Raylets, workers and fake autoscaled nodes all inherited the group: none may outlive the test.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def alive_nodes(head: Head) -> int:
    return _alive_nodes(head.gcs_address, head.env)


def leftover_processes(head: Head) -> list[str]:
    """Processes whose command line still names the head's temp dir or GCS port."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(head.temp_dir) in cmd or head.gcs_address in cmd:
                found.append(f"{entry.name}: {cmd[:120]}")
    return found
