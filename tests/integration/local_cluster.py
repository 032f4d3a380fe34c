"""A Ray head of a test's own: `ray start --head --block` on this machine with a private temp dir
and free ports (dashboard and job API on 127.0.0.1 only), in its own process group, stopped by killing that group (never `ray stop`, which would
take down every Ray on the machine, the test session's included)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BIN = Path(sys.executable).parent


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
    code = ("import ray; ray.init(address=%r, logging_level='ERROR'); "
            "print(sum(n['Alive'] for n in ray.nodes()))" % gcs)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else 0


@contextlib.contextmanager
def local_head(num_cpus: int, dashboard: bool = False, autoscaling: dict | None = None):
    """Yield a running Head; everything it started is killed on exit, also when the test fails."""
    temp_dir = Path(tempfile.mkdtemp(prefix="rh", dir="/tmp"))  # short: Ray's socket paths are capped
    port, dash = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    # A throwaway cluster reachable only from this machine: token auth would make every client find
    # the token the head minted in ~/.ray, which a concurrent Ray session may rewrite.
    env["RAY_AUTH_MODE"] = "disabled"
    cmd = [str(BIN / "ray"), "start", "--head", "--block",
           f"--port={port}", f"--temp-dir={temp_dir}", f"--num-cpus={num_cpus}",
           f"--include-dashboard={'true' if dashboard else 'false'}",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--disable-usage-stats"]
    if autoscaling is not None:
        # What ray.cluster_utils.AutoscalingCluster does, minus its global `ray stop --force`.
        config = temp_dir / "autoscaling.json"
        config.write_text(json.dumps(autoscaling))
        cmd.append(f"--autoscaling-config={config}")
        env.update({"AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_FAKE_CLUSTER": "1"})
    log = open(temp_dir / "ray-start.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    # Ray advertises the machine's own address even when told 127.0.0.1 (and then refuses drivers
    # that dial 127.0.0.1), so the head takes that address; the dashboard stays on loopback.
    from ray._private.services import get_node_ip_address

    gcs = f"{get_node_ip_address()}:{port}"
    try:
        deadline = time.time() + 120
        while _alive_nodes(gcs, env) < 1:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"ray head did not start: {(temp_dir / 'ray-start.log').read_text()[-2000:]}")
            time.sleep(1)
        yield Head(gcs, f"http://127.0.0.1:{dash}", temp_dir, {**env, "RAY_ADDRESS": gcs})
    finally:
        _kill_group(proc)
        log.close()


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
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
