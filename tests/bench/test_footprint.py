"""bench/footprint.py's disk figures, sampled from outside a real process tree."""

from __future__ import annotations

import subprocess
import sys

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


def test_the_streamed_adamw_s_rings_count_once_each_though_mapped_twice():
    """A ring is shared memory (a memfd) mapped twice back to back: RSS - RssShmem leaves
    it out, so the footprint adds each ring once, at its size."""
    footprint = load_bench("footprint")
    child = subprocess.Popen(
        [sys.executable, "-c",
         "from tierstack.services.tier_manager.adamw_stream import MirrorRing\n"
         "import sys, time\n"
         "rings = [MirrorRing(3 << 20), MirrorRing(5 << 20)]\n"
         "print('ready', flush=True)\n"
         "sys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert footprint.scratch_bytes([child.pid]) == 8 * MIB
        assert footprint.footprint(child.pid) >= 8 * MIB
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert footprint.scratch_bytes([child.pid]) == 0  # gone with the process
