"""bench/footprint.py's disk figures, sampled from outside a real process tree."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.bench import load_bench

MIB = 1 << 20

# A parent that starts a child writing 24 MiB (fsync'd), reaps it, waits, writes 8 MiB of
# its own and waits again, so the sampler sees the child alive, then gone, then the parent.
_TREE = """
import os, subprocess, sys, time
def write(path, n):
    with open(path, "wb") as f:
        f.write(os.urandom(n)); f.flush(); os.fsync(f.fileno())
    os.remove(path)
subprocess.run([sys.executable, "-c",
                "import os, sys, time; time.sleep(0.6); " +
                "f = open(sys.argv[1], 'wb'); f.write(os.urandom(24 << 20)); f.flush(); " +
                "os.fsync(f.fileno()); f.close(); os.remove(sys.argv[1]); time.sleep(0.6)",
                sys.argv[1] + ".child"], check=True)
time.sleep(0.6)
write(sys.argv[1] + ".parent", 8 << 20)
time.sleep(0.6)
"""


def test_a_reaped_childs_writes_count_once(tmp_path):
    footprint = load_bench("footprint")
    proc = subprocess.Popen([sys.executable, "-c", _TREE, str(tmp_path / "f")])
    with footprint.Sampler(proc.pid, interval=0.05) as sampler:
        assert proc.wait(timeout=60) == 0
    written = sampler.disk_bytes[1]
    # Both writes once: 32 MiB, and well short of the 56 MiB a second count of the child gives.
    assert 32 * MIB <= written < 44 * MIB, written / MIB


def _hold(code: str) -> subprocess.Popen:
    """A child that runs `code`, says ready and holds what it made until its stdin closes."""
    child = subprocess.Popen([sys.executable, "-c", code + "\nprint('ready', flush=True)\nsys.stdin.read()\n"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    return child


def _release(child: subprocess.Popen) -> None:
    child.stdin.close()
    child.wait(timeout=30)


def test_the_streamed_adamw_s_rings_count_once_each_though_mapped_twice():
    """A ring is shared memory (a memfd) mapped twice back to back: RSS - RssShmem leaves
    it out; PSS counts each page once though two mappings hold it."""
    footprint = load_bench("footprint")
    before = _hold("import sys, torch")
    try:
        baseline = footprint.footprint(before.pid)
    finally:
        _release(before)
    child = _hold("import sys, torch\n"
                  "from tierstack.services.tier_manager.adamw_stream import MirrorRing\n"
                  "rings = [MirrorRing(24 << 20), MirrorRing(40 << 20)]")
    try:
        grown = footprint.footprint(child.pid) - baseline
        assert 56 * MIB <= grown <= 80 * MIB, grown / MIB  # 64 MiB of rings, once, not twice (128)
    finally:
        _release(child)


_SHARE = """
import mmap, sys, os, time
fd = os.memfd_create("shared-by-two")
os.ftruncate(fd, 64 << 20)
m = mmap.mmap(fd, 64 << 20)
m[:] = b"x" * (64 << 20)
pid = os.fork()
if pid == 0:
    sum(m[i] for i in range(0, 64 << 20, 4096))  # the child touches every page too
    print("ready", flush=True)
    sys.stdin.read()
    os._exit(0)
time.sleep(0.5)
sys.stdin.read()
os.waitpid(pid, 0)
"""


def test_shared_memory_two_processes_map_counts_once():
    """DeepSpeed's pinned buffers are shared memory: RSS - RssShmem counts them 0 times,
    RSS twice; the footprint once."""
    footprint = load_bench("footprint")
    child = subprocess.Popen([sys.executable, "-c", _SHARE], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        pids = footprint.process_tree(child.pid)
        assert len(pids) == 2
        assert footprint.physical_bytes(pids) >= 64 * MIB
        assert footprint.physical_bytes(pids) < 64 * MIB + 2 * 24 * MIB  # two small pythons besides
        assert footprint.rss_minus_shmem(pids) < 48 * MIB
    finally:
        _release(child)


def test_an_arena_counts_once_by_its_file(tmp_path):
    """An arena counts its allocated blocks once, whether it is mapped by one process, two,
    or none (an owned shm_dir's arenas count unmapped too)."""
    footprint = load_bench("footprint")
    arena = tmp_path / f"{footprint.ARENA_PREFIX}0"
    with open(arena, "wb") as f:
        f.write(b"a" * (32 << 20))
    child = _hold(f"import mmap, sys\nf = open({str(arena)!r}, 'r+b')\nm = mmap.mmap(f.fileno(), 0)\n"
                  "sum(m[i] for i in range(0, len(m), 4096))")
    other = _hold(f"import mmap, sys\nf = open({str(arena)!r}, 'r+b')\nm = mmap.mmap(f.fileno(), 0)\n"
                  "sum(m[i] for i in range(0, len(m), 4096))")
    try:
        both = footprint.physical_bytes([child.pid, other.pid])
        alone = footprint.physical_bytes([child.pid]) + footprint.physical_bytes([other.pid])
        assert alone - both >= 30 * MIB  # counted once together, once each alone
        assert footprint.arena_bytes(tmp_path) == 32 * MIB
    finally:
        _release(child)
        _release(other)
    assert footprint.physical_bytes([], owned_shm_dir=tmp_path) == 32 * MIB


def test_the_cross_check_sees_a_childs_allocation():
    footprint = load_bench("footprint")
    used_before = footprint.host_used_bytes()
    child = subprocess.Popen([sys.executable, "-c",
                              "import sys, time\nb = bytearray(512 << 20)\nprint('ready', flush=True)\n"
                              "sys.stdin.read()\n"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    with footprint.Sampler(child.pid, interval=0.05, used_before=used_before) as sampler:
        try:
            assert child.stdout.readline().strip() == "ready"
            time.sleep(0.3)
        finally:
            _release(child)
    assert sampler.peak >= 512 * MIB
    assert sampler.used_delta_peak >= 256 * MIB  # other programs move it too: a cross-check
    assert set(sampler.figures("host")) == {"host_peak", "host_used_delta_peak",
                                            "host_rss_minus_shmem_peak"}
