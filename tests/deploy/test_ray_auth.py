"""A client joins a Ray cluster with the auth mode and token that cluster takes, or is told in
one line what to set: never the ActorDiedError of a driver whose mode differs from its cluster's.

Two real Ray heads (`ray start --head --block`, each in a temp dir of its own and on free
ports, stopped by their process group): one with token auth on (deploy/cluster.yaml's
way: RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH the cluster's secrets' token), one with it
off. HOME is a scratch directory, so ~/.ray/auth_token is the test's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tierstack.addresses import SECURITY_DIR_ENV
from tierstack.rpc import write_secrets
from tierstack.worker.jobs.ray_auth import RayAuthError, gcs_answer, join_cluster_auth

RAY = Path(sys.executable).parent / "ray"
START_SECONDS = 90


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _ray_head(env: dict[str, str]):
    """A Ray head of this test's own; yields its GCS address."""
    from ray.util import get_node_ip_address

    temp = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))  # short: Ray's socket paths
    port = _free_port()
    proc = subprocess.Popen(
        [RAY, "start", "--head", "--block", f"--port={port}", f"--temp-dir={temp}", "--num-cpus=1",
         "--include-dashboard=false", f"--ray-client-server-port={_free_port()}",
         f"--dashboard-agent-listen-port={_free_port()}", "--disable-usage-stats"],
        env={**env, "RAY_enable_autoscaler_v2": "0"}, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"{get_node_ip_address()}:{port}"
    try:
        deadline = time.monotonic() + START_SECONDS
        while gcs_answer(address, None) not in ("ok", "refused"):
            assert proc.poll() is None and time.monotonic() < deadline, "the Ray head did not start"
            time.sleep(0.5)
        yield address
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:  # `ray start --block` often outwaits a SIGTERM by far (30 s here): a short grace
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for entry in Path("/proc").iterdir():  # whatever of that head outlived its group
            with contextlib.suppress(OSError, ProcessLookupError):
                if entry.name.isdigit() and str(temp) in (entry / "cmdline").read_text():
                    os.kill(int(entry.name), signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def secrets(tmp_path_factory) -> Path:
    return write_secrets(tmp_path_factory.mktemp("cluster") / "secrets")


def _user_env(home: Path) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != SECURITY_DIR_ENV},
            "HOME": str(home)}


@pytest.fixture(scope="module")
def token_cluster(home, secrets):
    with _ray_head({**_user_env(home), "RAY_AUTH_MODE": "token",
                    "RAY_AUTH_TOKEN_PATH": str(secrets / "token")}) as address:
        yield address


@pytest.fixture
def client_env(home, monkeypatch):
    """This process as a fresh client: no Ray or tierstack auth settings, HOME the scratch one."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(_user_env(home))
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


def _actor_answers(env: dict[str, str], address: str) -> subprocess.CompletedProcess:
    """A driver as `tierstack train --address` is one (Ray imported and its config read
    first, then join_cluster_auth, then ray.init), creating one actor on the cluster."""
    code = ("import ray, sys\nfrom ray._raylet import get_authentication_mode\n"
            "get_authentication_mode()\n"  # the config cached before the mode is set
            "from tierstack.worker.jobs.ray_auth import join_cluster_auth\n"
            "ray.init(address=join_cluster_auth(sys.argv[1]))\n"
            "@ray.remote\nclass A:\n    def f(self): return 42\n"
            "print('answer', ray.get(A.remote().f.remote(), timeout=60))")
    return subprocess.run([sys.executable, "-c", code, address], env=dict(env), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)


def test_a_client_without_the_clusters_token_is_told_in_one_line_what_to_set(token_cluster, home, client_env):
    (home / ".ray").mkdir(exist_ok=True)
    (home / ".ray" / "auth_token").write_text("an-earlier-local-ray-init-wrote-this")
    client_env["RAY_AUTH_TOKEN"] = "not-the-clusters-either"
    with pytest.raises(RayAuthError) as refused:
        join_cluster_auth(token_cluster)
    message = str(refused.value)
    assert "\n" not in message and token_cluster in message
    assert "$RAY_AUTH_TOKEN, ~/.ray/auth_token" in message  # what it tried
    assert SECURITY_DIR_ENV in message and "RAY_AUTH_TOKEN_PATH" in message  # what to set


def test_the_clusters_secrets_give_the_client_its_token_and_actors_run(token_cluster, home, secrets,
                                                                        client_env):
    (home / ".ray").mkdir(exist_ok=True)
    (home / ".ray" / "auth_token").write_text("an-earlier-local-ray-init-wrote-this")
    client_env[SECURITY_DIR_ENV] = str(secrets)
    assert join_cluster_auth(token_cluster) == token_cluster
    assert client_env["RAY_AUTH_MODE"] == "token"
    assert client_env["RAY_AUTH_TOKEN_PATH"] == str((secrets / "token").resolve())
    run = _actor_answers(client_env, token_cluster)
    assert "answer 42" in run.stdout, run.stdout[-3000:]


def test_a_cluster_without_token_auth_is_joined_without_one_whatever_auth_token_exists(home, client_env):
    """The issue's failure: ~/.ray/auth_token on the host made the driver send tokens to a
    cluster with auth off, and every actor was cancelled before it ran."""
    (home / ".ray").mkdir(exist_ok=True)
    (home / ".ray" / "auth_token").write_text("an-earlier-local-ray-init-wrote-this")
    with _ray_head({**_user_env(home), "RAY_AUTH_MODE": "disabled"}) as address:
        client_env["RAY_AUTH_MODE"] = "token"  # as a driver that ray.init'ed before would have
        assert join_cluster_auth(address) == address
        assert client_env["RAY_AUTH_MODE"] == "disabled"
        run = _actor_answers(client_env, address)
        assert "answer 42" in run.stdout, run.stdout[-3000:]


def test_no_cluster_to_find_is_one_line_too(client_env, tmp_path):
    client_env["RAY_ADDRESS"] = f"127.0.0.1:{_free_port()}"  # nobody listens there
    with pytest.raises(RayAuthError, match="does not answer") as refused:
        join_cluster_auth("auto")
    assert "\n" not in str(refused.value)
