"""The daemon over real gRPC (unix socket), driven by the worker's client."""

import json
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from tierstack.errors import InvalidArgumentError, KeyNotFoundError, PoolExhaustedError
from tierstack.worker.store.arenas import ArenaMap
from tierstack.services.tier_manager.client import TierManagerClient
from tierstack.service_process import ServiceProcess
from tests.conftest import tier_manager_process


def write(client: TierManagerClient, arenas: ArenaMap, key: str, data: torch.Tensor, durable=True):
    flat = data.contiguous().view(-1).view(torch.uint8)
    lease = client.allocate(flat.numel())
    arenas.view(lease.arena, lease.offset, flat.numel()).copy_(flat)
    return client.commit(key, lease.lease_id, "uint8", (flat.numel(),), durable)


def test_health_node_info_and_a_round_trip_through_shared_memory(daemon):
    client = TierManagerClient(daemon.address)
    node = client.node()
    assert node.cpu_capacity == 16 << 20 and node.arenas == ()  # arenas come as needed
    arenas = ArenaMap(node, pin_for_cuda=False, describe=client.node)
    data = torch.randint(0, 255, (3_000_000,), dtype=torch.uint8)
    info = write(client, arenas, "a/b", data)
    assert info.nbytes == 3_000_000 and info.on_nvme and info.in_cpu
    client.evict(["a/b"])
    (res,) = client.fetch(["a/b"]).tensors
    assert torch.equal(arenas.view(res.arena, res.offset, res.info.nbytes), data)
    assert client.stats().pinned == 1
    client.release("a/b", res.info.version)
    assert client.stats().pinned == 0
    assert client.stats().nvme_bytes_read >= 3_000_000


def test_errors_map_to_grpc_statuses_with_useful_messages(daemon):
    client = TierManagerClient(daemon.address)
    with pytest.raises(KeyNotFoundError, match="no tensor is stored under key 'missing'"):
        client.fetch(["missing"])
    lease = client.allocate(100)
    with pytest.raises(InvalidArgumentError, match="needs 400 bytes but the buffer holds 100"):
        client.commit("k", lease.lease_id, "float32", (100,), True)
    with pytest.raises(InvalidArgumentError, match="unsupported dtype 'complex7'"):
        client.commit("k", lease.lease_id, "complex7", (100,), True)
    client.commit("k", lease.lease_id, "uint8", (100,), True)  # the lease survived the errors
    with pytest.raises(InvalidArgumentError, match="lease .* is unknown"):
        client.commit("k2", lease.lease_id, "uint8", (100,), True)
    with pytest.raises(PoolExhaustedError, match="larger than the whole CPU pool"):
        client.allocate(64 << 20)
    # RESOURCE_EXHAUSTED when the pool is full of pinned tensors and nothing can be evicted.
    node = client.node()
    arenas = ArenaMap(node, pin_for_cuda=False, describe=client.node)
    keys = []
    for i in range(2):  # 10 of the 16 MiB in two tensors, then pinned
        write(client, arenas, f"big{i}", torch.zeros(5 << 20, dtype=torch.uint8))
        keys.append(f"big{i}")
    pins = client.fetch(keys).tensors
    with pytest.raises(PoolExhaustedError, match="CPU pool full"):
        client.allocate(7 << 20)
    for key, res in zip(keys, pins):
        client.release(key, res.info.version)
    client.allocate(7 << 20)  # evicts now
    with grpc.insecure_channel(daemon.address) as channel:  # the raw status code, too
        from tierstack.proto import tier_manager_pb2 as pb, tier_manager_pb2_grpc as pbg
        with pytest.raises(grpc.RpcError) as err:
            pbg.TierManagerStub(channel).Describe(pb.DescribeRequest(key="nope"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_worker_maps_arenas_as_they_come_and_unmaps_the_ones_returned(daemon_config, tmp_path):
    """The daemon's pool grows arena by arena and returns idle empty ones; a worker's
    ArenaMap maps an arena when an answer first names it and drops it once an answer's
    epoch says it was returned (its memory goes back to the host only then). Blocks of
    600 KB: above the 64 KiB a 16 MiB pool shares, so each has an arena of its own."""
    import json
    from tests.conftest import tier_manager_process
    from tierstack.worker.store.tier_session import TierSession

    config = json.loads(daemon_config.read_text())
    config["tier_manager"]["cpu_pool"]["keep_empty_seconds"] = 0.5
    daemon_config.write_text(json.dumps(config))
    with tier_manager_process(daemon_config, tmp_path / "tm2.sock") as proc:
        session = TierSession(proc.address, reconnect_timeout=10, pin_for_cuda=False)
        try:
            assert session.arenas.mapped == []
            for i in range(3):
                session.write_block(f"t{i}", torch.full((600_000,), i, dtype=torch.uint8))
            assert len(session.arenas.mapped) == 3
            assert torch.equal(session.read_block("t1"), torch.full((600_000,), 1, dtype=torch.uint8))
            session.client.delete(["t0", "t1"])
            deadline = time.monotonic() + 10
            while len(session.client.node().arenas) != 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert len(session.client.node().arenas) == 1  # idle arenas went back to the host
            assert torch.equal(session.read_block("t2"), torch.full((600_000,), 2, dtype=torch.uint8))
            assert len(session.arenas.mapped) == 1  # the answer's epoch moved: unmapped here too
        finally:
            session.close()


def test_a_worker_maps_only_the_arenas_an_answer_names(daemon):
    """Arenas another worker filled are listed but not mapped (on a GPU: not page-locked)
    until an answer names one: a second session that reads one block maps its arena only."""
    from tierstack.worker.store.tier_session import TierSession

    writer = TierSession(daemon.address, reconnect_timeout=10, pin_for_cuda=False)
    try:
        for i in range(3):
            writer.write_block(f"m{i}", torch.full((300_000,), i, dtype=torch.uint8))
        reader = TierSession(daemon.address, reconnect_timeout=10, pin_for_cuda=False)
        try:
            assert len(reader.client.node().arenas) >= 1 and reader.arenas.mapped == []
            assert torch.equal(reader.read_block("m1"), torch.full((300_000,), 1, dtype=torch.uint8))
            assert 1 <= len(reader.arenas.mapped) <= len(writer.arenas.mapped)
            assert len(reader.arenas.mapped) < len(reader.client.node().arenas) or \
                len(reader.client.node().arenas) == 1
        finally:
            reader.close()
        writer.client.delete([f"m{i}" for i in range(3)])
    finally:
        writer.close()


def test_many_concurrent_clients(daemon):
    errors = []

    def worker(n: int) -> None:
        try:
            client = TierManagerClient(daemon.address)
            arenas = ArenaMap(client.node(), pin_for_cuda=False, describe=client.node)
            for i in range(10):
                data = torch.full((200_000 + n,), n * 10 + i, dtype=torch.uint8)
                write(client, arenas, f"c{n}/{i}", data, durable=i % 2 == 0)
                (res,) = client.fetch([f"c{n}/{i}"]).tensors
                if not torch.equal(arenas.view(res.arena, res.offset, res.info.nbytes), data):
                    errors.append((n, i))
                client.release(f"c{n}/{i}", res.info.version)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert errors == []


def test_graceful_shutdown_and_restart_keep_durable_tensors(daemon):
    client = TierManagerClient(daemon.address, reconnect_timeout=30)
    arenas = ArenaMap(client.node(), pin_for_cuda=False, describe=client.node)
    data = torch.arange(1_000_000, dtype=torch.int32)
    write(client, arenas, "kept", data)
    assert daemon.stop() == 0  # SIGTERM
    daemon.start()
    node = client.node()
    assert node.instance_id != arenas.instance_id
    arenas = ArenaMap(node, pin_for_cuda=False, describe=client.node)
    (res,) = client.fetch(["kept"]).tensors
    assert torch.equal(arenas.view(res.arena, res.offset, res.info.nbytes).view(torch.int32), data)


def test_generated_grpc_code_is_in_sync_with_proto(tmp_path):
    from proto.generate import PROTO_DIR, generate
    for path in generate(tmp_path):
        committed = PROTO_DIR / path.name
        assert committed.read_text() == path.read_text(), (
            f"{committed.name} is out of date with proto/: run `make proto`")


def test_a_taken_address_gets_a_clear_error(daemon_config, tmp_path):
    import socket
    import subprocess
    import sys
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "tierstack.cli", "tier-manager", "--config",
                              str(daemon_config), "--listen", f"127.0.0.1:{port}"],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "cannot listen on 127.0.0.1" in out.stderr and "--listen" in out.stderr


def test_a_second_daemon_on_the_same_socket_is_refused(daemon, daemon_config):
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "tierstack.cli", "tier-manager", "--config",
                          str(daemon_config), "--listen", daemon.address],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "already listening" in out.stderr
    TierManagerClient(daemon.address).node()  # the first one is untouched


def test_sigterm_lets_an_in_flight_durable_write_finish(tmp_path, shm_dir):
    import json
    import time
    from tests.conftest import tier_manager_process
    config = tmp_path / "big.json"
    config.write_text(json.dumps({"tier_manager": {
        "cpu_pool": {"size": "320MiB", "shm_dir": str(shm_dir)},
        "nvme_pool": {"paths": [str(tmp_path / "nvme")], "size": "640MiB"},
        "manifest_path": str(tmp_path / "m.sqlite"), "shutdown_grace_seconds": 60}}))
    daemon = tier_manager_process(config, tmp_path / "big.sock").start()
    try:
        client = TierManagerClient(daemon.address)
        arenas = ArenaMap(client.node(), pin_for_cuda=False, describe=client.node)
        data = torch.randint(0, 255, (300 << 20,), dtype=torch.uint8)
        lease = client.allocate(data.numel())
        arenas.view(lease.arena, lease.offset, data.numel()).copy_(data)
        result = {}

        def commit():
            try:
                result["info"] = client.commit("big", lease.lease_id, "uint8", (data.numel(),), True)
            except Exception as e:  # noqa: BLE001
                result["error"] = e

        t = threading.Thread(target=commit)
        t.start()
        time.sleep(0.05)  # the 300 MiB write is under way
        daemon.proc.send_signal(signal.SIGTERM)
        t.join(timeout=120)
        assert "error" not in result, result.get("error")
        assert result["info"].on_nvme
        assert daemon.proc.wait(timeout=120) == 0
        daemon.start()
        client = TierManagerClient(daemon.address)
        arenas = ArenaMap(client.node(), pin_for_cuda=False, describe=client.node)
        (res,) = client.fetch(["big"]).tensors
        assert torch.equal(arenas.view(res.arena, res.offset, res.info.nbytes), data)
    finally:
        daemon.kill()


def test_a_lease_never_committed_is_freed_after_its_timeout(tmp_path, shm_dir):
    import json
    import time
    from tests.conftest import tier_manager_process
    config = tmp_path / "lease.json"
    config.write_text(json.dumps({"tier_manager": {
        "cpu_pool": {"size": "8MiB", "shm_dir": str(shm_dir)},
        "nvme_pool": {"paths": [str(tmp_path / "nvme")], "size": "64MiB"},
        "manifest_path": str(tmp_path / "m.sqlite"), "lease_timeout_seconds": 0.5}}))
    daemon = tier_manager_process(config, tmp_path / "lease.sock").start()
    try:
        client = TierManagerClient(daemon.address)
        lease = client.allocate(4 << 20)  # a worker that then dies
        assert client.stats().cpu_used == 4 << 20
        deadline = time.time() + 10
        while client.stats().leases and time.time() < deadline:
            time.sleep(0.1)
        stats = client.stats()
        assert stats.leases == 0 and stats.cpu_used == 0
        with pytest.raises(InvalidArgumentError, match="expired"):
            client.commit("late", lease.lease_id, "uint8", (4 << 20,), True)
        # A pin a dead worker never released expires the same way.
        arenas = ArenaMap(client.node(), pin_for_cuda=False, describe=client.node)
        write(client, arenas, "pinned", torch.zeros(1 << 20, dtype=torch.uint8))
        (res,) = client.fetch(["pinned"]).tensors
        assert client.stats().pinned == 1
        deadline = time.time() + 10
        while client.stats().pinned and time.time() < deadline:
            time.sleep(0.1)
        assert client.stats().pinned == 0
        with pytest.raises(InvalidArgumentError, match="not fetched"):
            client.release("pinned", res.info.version)
    finally:
        daemon.kill()


def test_embedded_daemons_die_with_the_job_that_started_them(daemon_config, tmp_path, shm_dir):
    """A job killed with SIGKILL (no clean-up runs) leaves no tier manager or scheduler
    behind: they notice their starter is gone and shut down, arenas, socket and private
    directory removed."""
    import json
    import os
    import subprocess
    import sys

    job = subprocess.Popen([sys.executable, "-c", f"""
import json, sys, time
from tierstack.config import load_config
from tierstack.services.scheduler.embedded import EmbeddedScheduler
from tierstack.services.tier_manager.embedded import EmbeddedTierManager
tm = load_config(json.load(open({str(daemon_config)!r}))).tier_manager
with EmbeddedScheduler() as scheduler, EmbeddedTierManager(tm) as daemon:
    print(json.dumps([scheduler.proc.pid, daemon.proc.pid, daemon.address,
                      str(scheduler.workdir), str(daemon.workdir)]), flush=True)
    time.sleep(600)
"""], stdout=subprocess.PIPE, text=True)
    try:
        scheduler_pid, daemon_pid, address, *workdirs = json.loads(job.stdout.readline())
        assert all(os.path.isdir(d) for d in workdirs)
        client = TierManagerClient(address)
        arenas = ArenaMap(client.node(), pin_for_cuda=False, describe=client.node)
        write(client, arenas, "job/x", torch.ones(1 << 20, dtype=torch.uint8), durable=False)
        assert client.node().arenas  # serving, an arena made
        arenas.close()
        client.close()
        job.kill()
        job.wait()
    finally:
        job.kill()

    def gone(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # A zombie of ours would still answer signal 0; these were reparented to init.
        return open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] == "Z"

    deadline = time.monotonic() + 60
    while not (gone(scheduler_pid) and gone(daemon_pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert gone(scheduler_pid) and gone(daemon_pid), "an embedded daemon outlived its job"
    assert not any(p.name.startswith("tierstack-arena-") for p in shm_dir.iterdir())
    # Their private directories (config, socket, log) went with them: the job never ran
    # its clean-up.
    assert not any(os.path.exists(d) for d in workdirs), workdirs


def test_thousands_of_resident_tensors_under_ulimit_n_1024(tmp_path, shm_dir):
    """One arena per tensor cost the daemon a descriptor each: under `ulimit -n 1024`
    every allocation failed after ~1,000 tensors, with a message blaming vm.max_map_count.
    Now a daemon started under that limit holds 3,000 resident tensors in 12 shared arenas
    (of 1 MiB, 256 buffers each), its descriptors as few as at start."""
    import json
    import subprocess
    import sys

    config = tmp_path / "tm.json"
    config.write_text(json.dumps({"tier_manager": {
        "cpu_pool": {"size": "64MiB", "shm_dir": str(shm_dir)},
        "nvme_pool": {"paths": [str(tmp_path / "nvme")], "size": "64MiB"},
        "manifest_path": str(tmp_path / "m.sqlite"), "metrics": {"enabled": False}}}))
    code = f"""
import json, os, resource, subprocess, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))  # the daemon inherits it
from tierstack.services.tier_manager.client import TierManagerClient
sock = {str(tmp_path / "tm.sock")!r}
daemon = subprocess.Popen([sys.executable, "-m", "tierstack.cli", "tier-manager", "--config",
                           {str(config)!r}, "--listen", "unix:" + sock])
try:
    client = TierManagerClient("unix:" + sock, reconnect_timeout=60)
    client.node()
    start = len(os.listdir(f"/proc/{{daemon.pid}}/fd"))
    for i in range(3000):
        lease = client.allocate(4)
        client.commit(f"j/t{{i}}", lease.lease_id, "uint8", (4,), False, "cpu")
    stats = client.stats()
    print(json.dumps([stats.tensors, len(client.node().arenas), start,
                      len(os.listdir(f"/proc/{{daemon.pid}}/fd"))]))
finally:
    daemon.kill()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    tensors, arenas, fds_before, fds_after = json.loads(out.stdout.splitlines()[-1])
    assert tensors == 3000 and arenas == 12
    assert fds_after <= fds_before + 4, (fds_before, fds_after)


def test_a_low_open_files_limit_is_named_with_its_fix_by_doctor_and_the_daemon(tmp_path, daemon_config):
    """`tierstack doctor` reports the open-files limit and vm.max_map_count; a tier manager
    started where `ulimit -n` is too low for it says at start which limit to raise and how."""
    import subprocess
    import sys

    low = "import resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)); "
    doctor = subprocess.run([sys.executable, "-c", low + "from tierstack.cli import main; "
                             f"sys.exit(main(['doctor', '--quick', '--nvme-path', {str(tmp_path / 'n')!r}]))"],
                            capture_output=True, text=True, timeout=120)
    assert "[warn] open files" in doctor.stdout and "256/256 soft/hard" in doctor.stdout
    assert "-> raise it: ulimit -n 2048" in doctor.stdout
    assert "memory maps" in doctor.stdout and "vm.max_map_count" in doctor.stdout
    started = subprocess.Popen(
        [sys.executable, "-c", low + "from tierstack.cli import main; sys.exit(main(["
         f"'tier-manager', '--config', {str(daemon_config)!r}, '--listen', "
         f"'unix:{tmp_path / 'low.sock'}']))"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    try:
        lines = []
        for line in started.stdout:
            lines.append(line)
            if "listening on" in line or len(lines) > 200:
                break
        text = "".join(lines)
        assert "open files: open files (ulimit -n) 256/256" in text and "raise it: ulimit -n 2048" in text
    finally:
        started.kill()
        started.wait()


def test_a_read_only_nvme_path_fails_the_start_in_one_line(mounted, tmp_path):
    """A read-only --nvme-path ended in a traceback (OSError from makedirs); now one line
    that names the path, why, and the setting to change, both for a directory still to
    make and for one that exists, and for a read-only manifest directory."""
    import subprocess
    import sys

    ro = mounted("tmpfs", "size=1m")
    (ro / "exists").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
    import json

    config = tmp_path / "tm.json"
    config.write_text(json.dumps({"tier_manager": {
        "nvme_pool": {"paths": [str(tmp_path / "nvme")], "size": "64MiB"},
        "manifest_path": str(ro / "exists" / "manifest.sqlite")}}))
    cases = [(["--nvme-path", str(ro / "new")], f"NVMe pool directory {ro / 'new'} cannot be used",
              "tier_manager.nvme_pool.paths (--nvme-path)"),
             (["--nvme-path", str(ro / "exists")], f"NVMe pool directory {ro / 'exists'} cannot be used",
              "tier_manager.nvme_pool.paths (--nvme-path)"),
             (["--config", str(config)], f"manifest directory {ro / 'exists'} cannot be used",
              "tier_manager.manifest_path")]
    for argv, says, setting in cases:
        out = subprocess.run([sys.executable, "-m", "tierstack.cli", "tier-manager", *argv,
                              "--listen", f"unix:{tmp_path / 'ro.sock'}"],
                             capture_output=True, text=True, timeout=120)
        errors = [line for line in out.stderr.splitlines() if line.startswith("tierstack:")]
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert len(errors) == 1 and says in errors[0] and "read-only filesystem" in errors[0]
        assert setting in errors[0], errors[0]


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return "libtorch_cpu" in maps.read()


def test_a_daemon_serves_without_torch_and_a_training_jobs_daemon_makes_its_adamw_as_it_starts(
        daemon_config: Path, tmp_path: Path):
    """A plain start imports no torch (about 2 s of every start); --preload-optimizer, which
    a job's own daemon gets, makes the AdamW stepper right after it serves, not on step 1."""
    plain = tier_manager_process(daemon_config, tmp_path / "plain.sock").start()
    try:
        assert TierManagerClient(plain.address).node().arenas is not None  # it answers
        assert not _maps_torch(plain.proc.pid), "the daemon imported torch before any step"
    finally:
        plain.stop()
    section = json.loads(daemon_config.read_text())["tier_manager"]
    preloading = ServiceProcess("tier-manager", "tier_manager", section, listen=f"unix:{tmp_path / 'pre.sock'}",
                                workdir=tmp_path / "pre-daemon", args=["--preload-optimizer"]).start()
    try:
        deadline = time.monotonic() + 60
        while "AdamW kernel:" not in preloading.log_path.read_text():
            assert time.monotonic() < deadline, preloading.log_path.read_text()[-2000:]
            time.sleep(0.1)
        assert _maps_torch(preloading.proc.pid)
    finally:
        preloading.stop()
