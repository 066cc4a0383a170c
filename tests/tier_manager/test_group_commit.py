"""Rows in groups (durable.py): a non-durable streamed AdamW step's new versions are synced
and recorded by the manifest's group thread, never on the step's own path, and a crash
at any moment leaves every key at a version it really had, intact."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from tierstack.config import AioConfig, CpuPoolConfig, NvmePoolConfig, TierManagerConfig, config_dict
from tierstack.services.tier_manager.adamw import AdamWStepper
from tierstack.services.tier_manager.nvme_pool import NvmePool
from tierstack.services.tier_manager.registry import TierRegistry
from tierstack.services.tier_manager.types import AdamWBlock, AdamWHyper, AdamWSegment

NUMEL = 1 << 20  # 4 MiB per fp32 tensor: three of them and the gradients exceed a 2 MiB pool
KEYS = ("b/params", "b/exp_avg", "b/exp_avg_sq")


def _config(tmp_path, shm_dir) -> TierManagerConfig:
    return TierManagerConfig(
        cpu_pool=CpuPoolConfig(size=2 << 20, shm_dir=str(shm_dir)),
        nvme_pool=NvmePoolConfig(paths=[str(tmp_path / "d0"), str(tmp_path / "d1")], size=128 << 20,
                                 aio=AioConfig(block_size=256 << 10, queue_depth=4)),
        manifest_path=str(tmp_path / "manifest.sqlite"))


BLOCK = AdamWBlock("b/params", "b/grad", "", "b/exp_avg", "b/exp_avg_sq", "float32", "float32",
                   NUMEL * 4, (AdamWSegment(NUMEL, 0, 0, 0),), state_placement="nvme")


def _hyper(step: int) -> AdamWHyper:
    return AdamWHyper(step, 1e-2, 0.9, 0.95, 1e-8, 0.1, release_gradients=True)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("durable", [False, True])
def test_a_streamed_step_syncs_on_its_own_path_only_when_durable(tmp_path, shm_dir, monkeypatch, durable):
    syncs: list[str] = []  # the thread of every NvmePool.sync (its fdatasyncs run on a pool)
    real = NvmePool.sync

    def counted(pool, extents) -> None:
        syncs.append(threading.current_thread().name)
        real(pool, extents)

    g = torch.Generator().manual_seed(3)
    config = _config(tmp_path, shm_dir)
    with TierRegistry(config) as reg:
        stepper = AdamWStepper(reg)
        try:
            reg.put("b/params", torch.randn(NUMEL, generator=g), tier="nvme")
            for step in (1, 2, 3):
                reg.put("b/grad", torch.randn(NUMEL, generator=g), tier="nvme")
                monkeypatch.setattr(NvmePool, "sync", counted)
                stepper.step([BLOCK], _hyper(step), durable=durable)
                reg.durable.drain()
                monkeypatch.setattr(NvmePool, "sync", real)
            assert stepper.streamed_blocks == 3
            final = {k: _digest(reg.get(k)) for k in KEYS}
        finally:
            stepper.close()
    on_the_path = [name for name in syncs if name != "tierstack-manifest-groups"]
    if durable:
        assert on_the_path, syncs  # a durable step returns with its versions synced
    else:
        assert syncs and not on_the_path, syncs  # synced, but by the group thread
    with TierRegistry(config) as reg:  # a clean stop: every version the steps made is kept
        assert {k: _digest(reg.get(k)) for k in KEYS} == final


_CHILD = """
import hashlib, json, sys, torch
from tierstack.config import load_config
from tierstack.services.tier_manager.adamw import AdamWStepper
from tierstack.services.tier_manager.registry import TierRegistry
from tests.tier_manager.test_group_commit import BLOCK, KEYS, _digest, _hyper, NUMEL
reg = TierRegistry(load_config(sys.argv[1]).tier_manager)
stepper = AdamWStepper(reg)
g = torch.Generator().manual_seed(4)
reg.put("b/params", torch.randn(NUMEL, generator=g), tier="nvme")
with open(sys.argv[2], "a") as out:
    for step in range(1, 10_000):
        reg.put("b/grad", torch.randn(NUMEL, generator=g), tier="nvme")
        stepper.step([BLOCK], _hyper(step))
        out.write(json.dumps({k: _digest(reg.get(k)) for k in KEYS}) + "\\n")
        out.flush()
"""


def test_a_crash_between_or_inside_non_durable_steps_leaves_every_key_at_a_version_it_had(
        tmp_path, shm_dir):
    config = _config(tmp_path, shm_dir)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"tier_manager": config_dict(config)}))
    seen = tmp_path / "seen.jsonl"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(path), str(seen)], cwd=root,
                            env={**os.environ, "PYTHONPATH": root})
    try:
        deadline = time.monotonic() + 240
        while not (seen.exists() and len(seen.read_text().splitlines()) >= 6):
            assert proc.poll() is None and time.monotonic() < deadline, "the child did not step"
            time.sleep(0.05)
        time.sleep(0.13)  # somewhere inside a later step
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    had = [json.loads(line) for line in seen.read_text().splitlines() if line.endswith("}")]
    with TierRegistry(config) as reg:
        assert set(KEYS) <= set(reg.keys())
        got = {k: _digest(reg.get(k)) for k in KEYS}  # every block's checksum verified
    # The versions a restart finds: one the child saw after some step, or (killed after a
    # group committed, before it wrote the line) the step after its last line.
    versions = {k: [h[k] for h in had] for k in KEYS}
    recent = {k: got[k] in versions[k][-3:] for k in KEYS}
    newer = {k: got[k] not in versions[k] for k in KEYS}
    assert all(recent[k] or newer[k] for k in KEYS), (got, versions)


_PAUSED_CHILD = """
import json, os, sys, torch
from tierstack.config import load_config
from tierstack.services.tier_manager.adamw import AdamWStepper
from tierstack.services.tier_manager.registry import TierRegistry
from tests.tier_manager.test_group_commit import BLOCK, KEYS, _digest, _hyper, NUMEL
reg = TierRegistry(load_config(sys.argv[1]).tier_manager)
stepper = AdamWStepper(reg)
g = torch.Generator().manual_seed(4)
reg.put("b/params", torch.randn(NUMEL, generator=g), tier="nvme")
for step in range(1, 5):
    if step == 3:  # every group from here on waits: a crash finds step 2's rows
        reg.durable.drain()
        print(json.dumps({k: _digest(reg.get(k)) for k in KEYS}), flush=True)
        reg.durable._commit_lock.acquire()
    reg.put("b/grad", torch.randn(NUMEL, generator=g), tier="cpu")
    stepper.step([BLOCK], _hyper(step))
os._exit(0)  # a crash: nothing is closed, no group runs
"""


def test_the_extents_a_committed_row_names_are_not_reused_before_the_next_row(tmp_path, shm_dir):
    """Steps 3 and 4 free step 2's extents and allocate anew while no group may commit:
    a restart must still read step 2's versions, bit for bit, through their checksums."""
    config = _config(tmp_path, shm_dir)
    # the gradients fit (CPU-only: no row); the state does not, nor a pool copy of the new
    # parameters (the stepper keeps one where the pool has room: the next update would then
    # run in the pool, and this test is about streamed ones)
    config.cpu_pool.size = 6 << 20
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"tier_manager": config_dict(config)}))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _PAUSED_CHILD, str(path)], cwd=root,
                         env={**os.environ, "PYTHONPATH": root}, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    after_step_2 = json.loads(out.stdout.splitlines()[-1])
    with TierRegistry(config) as reg:
        assert {k: _digest(reg.get(k)) for k in KEYS} == after_step_2
