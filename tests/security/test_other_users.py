"""Another local user against a root daemon (issue 14), played by `nobody`: they cannot
swap its socket, plant a file it writes through, read what it keeps, or call it over
loopback TCP. Root only (the test switches users); skipped otherwise."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import struct
import subprocess
import tempfile
from pathlib import Path

import pytest

from tierstack.errors import UnsafePathError
from tierstack.private_paths import ensure_private_dir, open_private_file
from tierstack.proto import tier_manager_pb2 as pb
from tierstack.service_process import ServiceProcess, ServiceStartError
from tierstack.services.tier_manager.client import TierManagerClient
from tierstack.services.tier_manager.nvme_pool import DATA_FILE
from tests.security.test_who_may_call import free_port

try:
    NOBODY = pwd.getpwnam("nobody")
except KeyError:
    NOBODY = None
pytestmark = pytest.mark.skipif(os.getuid() != 0 or NOBODY is None,
                                reason="needs root and a 'nobody' user to play the other user")


def as_nobody(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, user=NOBODY.pw_uid, group=NOBODY.pw_gid, extra_groups=[],
                          capture_output=True, text=True, timeout=30, cwd="/")


@pytest.fixture
def shared() -> Path:
    """A directory everyone may add names to, as /tmp and /var/tmp (root's, 1777)."""
    path = Path(tempfile.mkdtemp(prefix="tierstack-shared-", dir="/tmp"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def daemon(shm_dir: Path, pool: Path, listen: str, workdir: Path) -> ServiceProcess:
    return ServiceProcess("tier-manager", "tier_manager", {
        "cpu_pool": {"size": "8MiB", "shm_dir": str(shm_dir)},
        "nvme_pool": {"paths": [str(pool)], "size": "16MiB",
                      "aio": {"block_size": "256KiB", "queue_depth": 2}},
        "manifest_path": str(pool / "manifest.sqlite")},
        listen=listen, workdir=workdir, startup_timeout=30)


def test_a_socket_directory_another_user_made_or_can_write_is_refused(tmp_path, shm_dir, shared):
    theirs = shared / "sockets"
    assert as_nobody("mkdir", "-m", "0777", str(theirs)).returncode == 0
    with pytest.raises(ServiceStartError, match="belongs to another user"):
        daemon(shm_dir, tmp_path / "pool", f"unix:{theirs}/tm.sock", tmp_path / "tm").start()
    # A client will not talk through it either: the socket in it could be theirs.
    client = TierManagerClient(f"unix:{theirs}/tm.sock", reconnect_timeout=2)
    with pytest.raises(UnsafePathError, match="not ours alone"):
        client.node()
    client.close()
    ours = shared / "ours"
    ours.mkdir()
    ours.chmod(0o777)  # ours, but open to everyone
    with pytest.raises(UnsafePathError, match="writable by other users"):
        ensure_private_dir(ours, "the socket directory", "--listen")


def test_a_file_planted_where_the_daemon_writes_is_never_written_through(tmp_path, shm_dir, shared):
    victim = shared / "victim"  # root's file another user wants tensor bytes written into
    victim.write_bytes(b"root's data\n")
    victim.chmod(0o600)
    assert as_nobody("ln", "-s", str(victim), str(shared / DATA_FILE)).returncode == 0
    with pytest.raises(ServiceStartError, match="is a symlink"):
        daemon(shm_dir, shared, f"unix:{tmp_path}/tm.sock", tmp_path / "tm").start()
    assert victim.read_bytes() == b"root's data\n"
    # Their own file, or their directory, is refused the same way.
    assert as_nobody("touch", str(shared / "manifest.sqlite")).returncode == 0
    with pytest.raises(UnsafePathError, match="belongs to another user"):
        open_private_file(shared / "manifest.sqlite", os.O_RDWR | os.O_CREAT, "manifest")
    assert as_nobody("mkdir", str(shared / "pool")).returncode == 0
    with pytest.raises(UnsafePathError, match="belongs to another user"):
        ensure_private_dir(shared / "pool", "NVMe pool directory", "tier_manager.nvme_pool.paths")


def _grpc_frame(message) -> bytes:
    body = message.SerializeToString()
    return struct.pack(">BI", 0, len(body)) + body


def test_another_user_reads_nothing_and_is_refused_on_loopback_tcp(tmp_path, shm_dir, shared):
    """On loopback TCP with nothing configured the daemon uses the per-user TLS certificate
    and token in /tmp/tierstack-<uid>, which another user cannot read; their calls are
    refused (UNAUTHENTICATED, grpc-status 16) and logged."""
    address = f"127.0.0.1:{free_port()}"
    pool = shared / "node"
    with daemon(shm_dir, pool, address, tmp_path / "tm") as served:
        owner = TierManagerClient(address, reconnect_timeout=10)
        assert owner.node().instance_id  # we need no set-up on loopback
        owner.close()
        token = Path(f"/tmp/tierstack-{os.getuid()}/token")
        assert as_nobody("cat", str(token)).returncode != 0
        assert as_nobody("ls", str(pool)).returncode != 0
        for path in [pool, *pool.iterdir(), *shm_dir.iterdir()]:
            mode = stat.S_IMODE(path.stat().st_mode)
            assert mode == (0o700 if path.is_dir() else 0o600), f"{path}: {mode:04o}"
        request = shared / "delete.grpc"
        request.write_bytes(_grpc_frame(pb.DeleteRequest(keys=["root/params"])))
        request.chmod(0o644)
        answer = as_nobody(
            "curl", "-sk", "--http2", "-o", "/dev/null",
            "-D", "-", "-X", "POST", "-H", "content-type: application/grpc", "-H", "te: trailers",
            "--data-binary", f"@{request}",
            f"https://{address}/tierstack.tier_manager.v1.TierManager/Delete")
        assert "grpc-status: 16" in answer.stdout, answer
        assert "refused /tierstack.tier_manager.v1.TierManager/Delete" in served.log_text()
