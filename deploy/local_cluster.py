"""`tierstack local-cluster up|down`: deploy/cluster-local.yaml on this one machine.

Two loopback "nodes", 127.0.0.1 (head) and 127.0.0.2 (worker), stand for two machines:
an sshd of our own listens on both (Ray's launcher reaches nodes over SSH, port 22, so
root only), with its host key, a client key and its config in a private directory
(/tmp/tierstack-local-cluster-<uid>), which also holds the cluster yaml `ray up` gets
(cluster-local.yaml with that key) and the node config (deploy/node.json with the NVMe
pool inside the directory). The sshd gives each session TIERSTACK_HOME (this checkout)
and TIERSTACK_NODE_CONFIG, which the yaml's commands read on a real node too.

`up` records what exists before it starts, so that `down` (run also when `up` fails
half-way) removes exactly what `up` and Ray's launcher made: the cluster (`ray down`),
the sshd, the line the yaml's setup command appends to ~/.bashrc, ~/ray_bootstrap_*,
Ray's state and config caches (/tmp/ray/cluster-<name>.*, /tmp/ray-config-*, the SSH
control directory), the nodes' Ray sessions and tierstack directories, the secrets
if `up` made them, and the private directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


from tierstack.addresses import SECURITY_DIR_ENV, cluster_dir_name, node_dir, node_tier_manager_address, user_dir
from tierstack.errors import InvalidArgumentError
from tierstack.extras import require

REPO = Path(__file__).resolve().parents[1]
RAY = REPO / ".venv" / "bin" / "ray"
NODES = ("127.0.0.1", "127.0.0.2")
RAY_PORT = 6379
SECRETS = REPO / "deploy" / "secrets"
BASHRC_MARK = "tierstack-ray-path"  # the yaml's setup command tags its ~/.bashrc line
RAY_TEMP = Path("/tmp/ray")
UP_SECONDS, DOWN_SECONDS, READY_SECONDS = 600, 120, 300


def state_dir() -> Path:
    # Beside the per-user directory, not in it: that one is shared with every tierstack
    # process of the user (a test session that made it removes it when it ends).
    return Path(f"/tmp/tierstack-local-cluster-{os.getuid()}")


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _ray_env() -> dict[str, str]:
    # The v2 autoscaler (Ray's default) did not launch the local provider's worker; v1 does.
    return {**os.environ, "RAY_UP_enable_autoscaler_v2": "0", SECURITY_DIR_ENV: str(SECRETS)}


def cluster_address() -> str:
    """The cluster's Ray (GCS) address: Ray registers the loopback head under the machine's IP."""
    from tierstack.deploy.ray_node import ray_node_ip

    return f"{ray_node_ip(NODES[0])}:{RAY_PORT}"


def _before() -> dict:
    """What exists before `up`: `down` removes only what is new."""
    home = Path.home()
    bashrc = home / ".bashrc"
    return {
        "bashrc_had_mark": bashrc.exists() and BASHRC_MARK in bashrc.read_text(),
        "bashrc_existed": bashrc.exists(),
        "existing": [str(p) for p in _made_paths() if p.exists() or p.is_symlink()],
        "ray_sessions": sorted(str(p) for p in RAY_TEMP.glob("session_*")),
        "ray_current_cluster": _read(RAY_TEMP / "ray_current_cluster"),
        "session_latest": os.readlink(RAY_TEMP / "session_latest")
        if (RAY_TEMP / "session_latest").is_symlink() else None,
        "config_caches": sorted(str(p) for p in Path(tempfile.gettempdir()).glob("ray-config-*")),
    }


def _made_paths() -> list[Path]:
    """Files and directories `up` may create, removed by `down` unless they existed before."""
    import getpass
    import hashlib

    home, name = Path.home(), _config()["cluster_name"]
    ssh_root = Path("/tmp") / f"ray_ssh_{hashlib.sha256(getpass.getuser().encode()).hexdigest()[:10]}"
    cluster = user_dir() / cluster_dir_name(cluster_address())
    return [home / "ray_bootstrap_config.yaml", home / "ray_bootstrap_key.pem",
            RAY_TEMP / f"cluster-{name}.state", RAY_TEMP / f"cluster-{name}.lock",
            ssh_root / hashlib.sha256(name.encode()).hexdigest()[:10], ssh_root, cluster,
            *[user_dir() / f"ray-node-{role}-{ip}-for-{address}.log"  # start-node-services.sh's
              for role in ("head", "worker") for ip in _node_ips()
              for address in (cluster_address(), f"{NODES[0]}:{RAY_PORT}")],
            SECRETS, RAY_TEMP, user_dir()]


def _shared_dirs() -> list[Path]:
    """Directories of `_made_paths` that others may use too: removed only when new and empty."""
    import getpass
    import hashlib

    ssh_root = Path("/tmp") / f"ray_ssh_{hashlib.sha256(getpass.getuser().encode()).hexdigest()[:10]}"
    return [ssh_root, RAY_TEMP, user_dir()]


def _node_ips() -> list[str]:
    from tierstack.deploy.ray_node import ray_node_ip

    return [ray_node_ip(h) for h in NODES] + list(NODES)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _config() -> dict:
    import yaml  # Ray's dependency: the [cluster] extra

    return yaml.safe_load((REPO / "deploy" / "cluster-local.yaml").read_text())


def _write_files(d: Path) -> None:
    """Keys, sshd config, node config and cluster yaml in the private directory."""
    for name in ("host", "client"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    shutil.copy(d / "client.pub", d / "authorized_keys")
    node = json.loads((REPO / "deploy" / "node.json").read_text())
    node["tier_manager"]["nvme_pool"]["paths"] = [str(d / "nvme")]
    (d / "node.json").write_text(json.dumps(node, indent=1))
    (d / "sshd_config").write_text("\n".join([
        "Port 22", *(f"ListenAddress {h}" for h in NODES),
        f"HostKey {d / 'host'}", f"PidFile {d / 'sshd.pid'}",
        f"AuthorizedKeysFile {d / 'authorized_keys'}", "StrictModes no",
        "PermitRootLogin prohibit-password", "PasswordAuthentication no",
        "KbdInteractiveAuthentication no", "UsePAM no",
        f"SetEnv TIERSTACK_HOME={REPO} TIERSTACK_NODE_CONFIG={d / 'node.json'}", ""]))
    config = _config()
    config["auth"]["ssh_user"] = os.environ.get("USER") or "root"
    config["auth"]["ssh_private_key"] = str(d / "client")
    import yaml

    (d / "cluster.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def _start_sshd(d: Path) -> int:
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    if not os.path.exists(sshd):
        raise InvalidArgumentError("no sshd: install openssh-server (`make test` does, as root)")
    Path("/run/sshd").mkdir(exist_ok=True)  # its privilege-separation directory
    proc = subprocess.Popen([sshd, "-D", "-f", str(d / "sshd_config"), "-E", str(d / "sshd.log")],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 20
    while not all(_port_open(h, 22) for h in NODES):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise InvalidArgumentError(f"sshd did not start: {_read(d / 'sshd.log') or ''}"[-2000:])
        time.sleep(0.2)
    return proc.pid


def tier_manager_instance(node_ip: str, ray_address: str, timeout: float = 2.0) -> str | None:
    """The instance id of the tier manager of `node_ip` in the cluster at `ray_address`,
    or None when none answers within `timeout` seconds."""
    from tierstack.services.tier_manager.client import TierManagerClient

    client = TierManagerClient(node_tier_manager_address(node_ip, ray_address),
                               reconnect_timeout=timeout)
    try:
        return client.node().instance_id
    except Exception:  # noqa: BLE001 - not (or no longer) running
        return None
    finally:
        client.close()


def _tier_manager_answers(node_ip: str, timeout: float = 2.0) -> bool:
    return tier_manager_instance(node_ip, cluster_address(), timeout) is not None


def up() -> int:
    from tierstack.deploy.ray_node import ray_node_ip

    if os.geteuid() != 0:
        raise InvalidArgumentError("local-cluster up needs root: Ray's launcher reaches the "
                                   "nodes over SSH on port 22, where only root may listen")
    d = state_dir()
    if (d / "state.json").exists():
        raise InvalidArgumentError(f"a local cluster is up already (its state: {d}); "
                                   f"run `.venv/bin/tierstack local-cluster down` first")
    busy = [h for h in NODES if _port_open(h, 22)]
    if busy:
        raise InvalidArgumentError(f"something listens on port 22 of {', '.join(busy)}; stop it first")
    state = _before()
    d.mkdir(parents=True, mode=0o700)
    (d / "state.json").write_text(json.dumps(state))  # from here on, `down` can undo everything
    try:
        if not (SECRETS / "token").exists():
            subprocess.run([REPO / ".venv" / "bin" / "tierstack", "ray-node", "--make-secrets",
                            SECRETS], check=True, stdout=subprocess.DEVNULL)
        _write_files(d)
        state["sshd_pid"] = _start_sshd(d)
        (d / "state.json").write_text(json.dumps(state))
        subprocess.run([RAY, "up", "-y", "--no-config-cache", d / "cluster.yaml"], env=_ray_env(),
                       stdin=subprocess.DEVNULL, check=True, timeout=UP_SECONDS)
        nodes = [ray_node_ip(h) for h in NODES]
        deadline = time.monotonic() + READY_SECONDS  # the head's autoscaler starts the worker
        while not all(_tier_manager_answers(n) for n in nodes):
            if time.monotonic() > deadline:
                raise InvalidArgumentError(
                    f"the nodes' tier managers did not all answer within {READY_SECONDS} s; logs: "
                    f"{user_dir()}/ray-node-*.log, {user_dir() / cluster_dir_name(cluster_address())}")
            time.sleep(3)
    except BaseException as e:
        print(f"local-cluster up failed ({type(e).__name__}: {e}); removing what it made",
              file=sys.stderr)
        for log in sorted(user_dir().glob("ray-node-*.log")) + sorted(
                (user_dir() / cluster_dir_name(cluster_address())).glob("node-*/*.log")):
            print(f"--- the end of {log}:\n{(_read(log) or '')[-1500:]}", file=sys.stderr)
        down()
        return 1
    print(f"local cluster up: Ray at {cluster_address()}, nodes {NODES[0]} (head) and "
          f"{NODES[1]}, each with its tier manager; clients use {SECRETS} "
          f"(export {SECURITY_DIR_ENV}={SECRETS})")
    _print_cluster_view()
    return 0


def _print_cluster_view() -> None:
    """The head's cluster view (the scheduler's dashboard), and how to trust its certificate."""
    import re

    from tierstack.deploy.ray_node import ray_node_ip

    log = node_dir(ray_node_ip(NODES[0]), cluster_address()) / "scheduler.log"
    found = re.search(r"cluster metrics and dashboard on (\S+)/dashboard/", _read(log) or "")
    if found:
        url = found.group(1)
        print(f"cluster view: {url}/dashboard/")
        if url.startswith("https://"):
            print(f"  its certificate is the cluster's own: trust {SECRETS / 'ca.pem'} (import it in "
                  f"the browser as an authority), or: curl --cacert {SECRETS / 'ca.pem'} "
                  f"{url}/api/v1/cluster")


def down() -> int:
    d = state_dir()
    try:
        state = json.loads((d / "state.json").read_text())
    except OSError:
        print(f"no local cluster is up (no {d / 'state.json'})")
        return 0
    status = 0
    if (d / "cluster.yaml").exists():
        status = _ray_down(d / "cluster.yaml")
    deadline = time.monotonic() + 90  # `ray stop` stopped the raylets; the services follow them
    nodes = _node_ips()
    while any(_tier_manager_answers(n, 1.0) or (node_dir(n, cluster_address()) / "ray-node.pid").exists()
              for n in nodes):
        if time.monotonic() > deadline:
            print("the nodes' tier managers still run after 90 s; their directories are kept",
                  file=sys.stderr)
            return 1
        time.sleep(1)
    if state.get("sshd_pid"):
        _stop_sshd(state["sshd_pid"], d)
    _restore_bashrc(state)
    _remove_ray_sessions(state)
    for cache in set(Path(tempfile.gettempdir()).glob("ray-config-*")) - set(map(Path, state["config_caches"])):
        cache.unlink(missing_ok=True)  # `ray down` caches the resolved config, one file per run
    existing = set(state["existing"])
    shared = _shared_dirs()
    for path in _made_paths():
        if str(path) in existing or path in shared:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    shutil.rmtree(d, ignore_errors=True)
    for path in shared:  # deepest first; removed only when empty and new
        if str(path) not in existing:
            _rmdir(path)
    print("local cluster down: Ray, the node services, the sshd and every file `up` made are gone")
    return status


def _ray_down(cluster_yaml: Path) -> int:
    """`ray down`, bounded. It runs `ray stop` on the head over ssh, then waits until the
    provider's state file shows every node torn down; when that `ray stop` did not reach
    the head (seen once after a failed `up` on a loaded machine), the head's autoscaler
    lives on and rewrites the file, and `ray down` waits forever. The head is this host,
    so the way out is the same `ray stop` run here, then `ray down` again."""
    def ray_down() -> int:
        return subprocess.run([RAY, "down", "-y", cluster_yaml], env=_ray_env(),
                              stdin=subprocess.DEVNULL, timeout=DOWN_SECONDS).returncode
    try:
        return ray_down()
    except subprocess.TimeoutExpired:
        print(f"`ray down` did not finish within {DOWN_SECONDS} s (its `ray stop` did not "
              f"reach the head); running `ray stop` here, then `ray down` again", file=sys.stderr)
    subprocess.run([RAY, "stop"], env=_ray_env(), stdin=subprocess.DEVNULL, timeout=DOWN_SECONDS)
    return ray_down()


def _rmdir(path: Path) -> None:
    try:
        path.rmdir()  # only when empty: something else of this user's is in it otherwise
    except OSError:
        pass


def _stop_sshd(pid: int, d: Path) -> None:
    try:  # the pid is ours only while it runs our config
        if str(d / "sshd_config") not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
            return
        os.kill(pid, 15)
    except (OSError, ProcessLookupError):
        return
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)


def _restore_bashrc(state: dict) -> None:
    """Drop the PATH line the yaml's setup command appended (and only that)."""
    bashrc = Path.home() / ".bashrc"
    if state["bashrc_had_mark"] or not bashrc.exists():
        return
    lines = bashrc.read_text().splitlines(keepends=True)
    kept = [line for line in lines if BASHRC_MARK not in line]
    if not state["bashrc_existed"] and not "".join(kept).strip():
        bashrc.unlink()
    else:
        bashrc.write_text("".join(kept))


def _remove_ray_sessions(state: dict) -> None:
    """The nodes' Ray session directories (logs, sockets) that `up` made and no running
    process uses any more; Ray's pointers to the last cluster back as they were."""
    live = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                live.add((entry / "cmdline").read_bytes().decode(errors="replace"))
            except OSError:
                pass
    for session in set(RAY_TEMP.glob("session_*")) - set(map(Path, state["ray_sessions"])):
        if session.is_dir() and not session.is_symlink() and not any(str(session) in c for c in live):
            shutil.rmtree(session, ignore_errors=True)
    latest = RAY_TEMP / "session_latest"
    if latest.is_symlink() and os.readlink(latest) != state["session_latest"]:
        latest.unlink()
        if state["session_latest"]:
            latest.symlink_to(state["session_latest"])
    current = RAY_TEMP / "ray_current_cluster"
    if _read(current) != state["ray_current_cluster"]:
        if state["ray_current_cluster"] is None:
            current.unlink(missing_ok=True)
        else:
            current.write_text(state["ray_current_cluster"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["up", "down"],
                        help="up: sshd on 127.0.0.1/127.0.0.2 and `ray up` of "
                             "deploy/cluster-local.yaml; down: `ray down` and remove all `up` made")


def run(args: argparse.Namespace) -> int:
    require("cluster", "tierstack local-cluster")
    return up() if args.action == "up" else down()
