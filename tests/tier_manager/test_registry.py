import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.conftest import shm_bytes_used
from tierstack.errors import (DataCorruptionError, FailedPreconditionError, InvalidArgumentError,
                              KeyNotFoundError, NvmePoolFullError)
from tierstack.services.tier_manager.eviction import JobPlan
from tierstack.services.tier_manager.nvme_pool import DATA_FILE, LOCK_FILE
from tierstack.services.tier_manager.registry import TierRegistry, tensor_view

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]


def random_tensor(seed: int, max_elems: int = 200_000) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dtype = DTYPES[seed % len(DTYPES)]
    shape = tuple(int(x) for x in torch.randint(1, 60, (1 + seed % 3,), generator=g))
    n = 1
    for d in shape:
        n *= d
    shape = shape if n <= max_elems else (max_elems,)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


def cpu_bytes_held(reg: TierRegistry) -> int:
    """CPU pool bytes the registry's CPU-resident tensors account for (each rounded up to the
    pool's granule: 4 KiB, or a huge page on hugetlbfs)."""
    granule = reg.cpu_pool.granule
    return sum(-(-reg.info(k).nbytes // granule) * granule for k in reg.keys() if reg.info(k).in_cpu)


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and bytes(a.contiguous().view(torch.uint8).numpy()) == bytes(b.contiguous().view(torch.uint8).numpy()))


def test_tensors_round_trip_bit_exact_through_both_tiers_from_many_threads(tier_config):
    with TierRegistry(tier_config) as reg:
        errors = []

        def worker(t: int) -> None:
            try:
                for i in range(12):
                    seed = t * 1000 + i
                    x = random_tensor(seed)
                    key = f"thread{t}/tensor{i}"
                    reg.put(key, x, tier="nvme" if i % 2 else "cpu")
                    if not bit_equal(reg.get(key), x):
                        errors.append(key)
            except Exception as e:  # noqa: BLE001 - surfaced below
                errors.append(repr(e))

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert errors == []
        for t in range(4):
            for i in range(12):
                assert bit_equal(reg.get(f"thread{t}/tensor{i}"), random_tensor(t * 1000 + i))
        assert shm_bytes_used(tier_config.cpu_pool.shm_dir and __import__("pathlib").Path(tier_config.cpu_pool.shm_dir)) <= tier_config.cpu_pool.size


def test_cpu_pool_smaller_than_the_data_spills_to_nvme_without_loss(tier_config):
    # 8 MiB CPU pool, 24 x 1 MiB tensors put in the CPU tier: most must be evicted.
    with TierRegistry(tier_config) as reg:
        tensors = {f"t{i}": torch.randn(256 * 1024, generator=torch.Generator().manual_seed(i))
                   for i in range(24)}
        for k, v in tensors.items():
            reg.put(k, v, tier="cpu")
            assert reg.cpu_pool.used_bytes <= reg.cpu_pool.capacity
        infos = [reg.info(k) for k in tensors]
        assert sum(i.in_cpu for i in infos) <= 8 and all(i.in_cpu or i.on_nvme for i in infos)
        for k, v in tensors.items():
            info, buf = reg.fetch(k)  # brings evicted ones back, evicting others
            assert bit_equal(tensor_view(reg, info, buf), v)
            reg.release(k)
        assert reg.cpu_pool.used_bytes <= reg.cpu_pool.capacity


def test_fetched_tensors_are_never_evicted(tier_config):
    with TierRegistry(tier_config) as reg:
        for i in range(7):
            reg.put(f"pinned{i}", torch.full((256 * 1024,), float(i)), tier="cpu")
            reg.fetch(f"pinned{i}")
        reg.put("other", torch.zeros(256 * 1024), tier="cpu")
        with pytest.raises(Exception, match="CPU pool full"):
            reg.put("too-much", torch.zeros(512 * 1024), tier="cpu")
        for i in range(7):
            assert reg.info(f"pinned{i}").in_cpu
        with pytest.raises(FailedPreconditionError, match="release it first"):
            reg.evict("pinned0")  # a well-formed request the state refuses for now


def test_restarted_registry_finds_every_committed_tensor(tier_config):
    tensors = {f"layer.{i}.weight": random_tensor(i) for i in range(30)}
    with TierRegistry(tier_config) as reg:
        for k, v in tensors.items():
            reg.put(k, v, tier="nvme")
        reg.put("layer.3.weight", tensors["layer.3.weight"] * 2, tier="nvme")  # new version
        reg.put("volatile", torch.ones(10), tier="cpu")
        reg.delete("layer.7.weight")
        used = reg.nvme_pool.used_bytes
    tensors["layer.3.weight"] = tensors["layer.3.weight"] * 2
    del tensors["layer.7.weight"]
    with TierRegistry(tier_config) as reg:
        assert sorted(reg.keys()) == sorted(tensors)
        for k, v in tensors.items():
            assert bit_equal(reg.get(k), v), k
        assert reg.nvme_pool.used_bytes == used  # exactly the committed extents are reserved
        reg.put("new", torch.arange(1000), tier="nvme")  # allocations avoid recovered extents
        for k, v in tensors.items():
            assert bit_equal(reg.get(k), v), k


def test_killed_writer_loses_nothing_that_was_acknowledged(tier_config, tmp_path):
    """A process killed mid-stream leaves every acknowledged tensor readable, bit-exact."""
    import json
    cfg = tmp_path / "cfg.json"
    from tierstack.config import config_dict
    cfg.write_text(json.dumps({"tier_manager": config_dict(tier_config)}))  # the same node
    acked = tmp_path / "acked.txt"
    code = f"""
import torch, sys
from tierstack.config import load_config
from tierstack.services.tier_manager.registry import TierRegistry
reg = TierRegistry(load_config({str(cfg)!r}).tier_manager)
with open({str(acked)!r}, "a") as f:
    for i in range(10_000):
        reg.put(f"k{{i % 40}}", torch.full((300_000,), float(i)), tier="nvme")
        f.write(f"{{i}}\\n"); f.flush()
"""
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.time() + 60
    while time.time() < deadline and (not acked.exists() or len(acked.read_text().split()) < 60):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = [int(x) for x in acked.read_text().split()]
    assert len(done) >= 60
    with TierRegistry(tier_config) as reg:
        for slot in range(40):
            last_acked = max(i for i in done if i % 40 == slot)
            got = reg.get(f"k{slot}")
            # The newest acknowledged version, or one newer whose ack was cut off.
            assert got[0].item() in (last_acked, last_acked + 40), slot
            assert torch.equal(got, torch.full((300_000,), got[0].item()))


def test_flipped_byte_is_detected_and_no_data_is_returned(tier_config):
    with TierRegistry(tier_config) as reg:
        reg.put("w", torch.randn(300_000), tier="nvme")
        extent = reg.records.find("w").nvme
        drive, stripe = extent.stripes[0]
        path = os.path.join(tier_config.nvme_pool.paths[drive], DATA_FILE)
        with open(path, "r+b") as f:  # a byte of the data, past the extent's header
            f.seek(stripe.offset + extent.header + 1000)
            b = f.read(1)
            f.seek(stripe.offset + extent.header + 1000)
            f.write(bytes([b[0] ^ 1]))
        with pytest.raises(DataCorruptionError, match="'w' block 0"):
            reg.get("w")
        with pytest.raises(DataCorruptionError):
            reg.fetch("w")
        assert reg.cpu_pool.used_bytes == cpu_bytes_held(reg) == 0  # the buffer went back


def test_full_nvme_pool_gives_a_clear_error_and_keeps_old_versions(tier_config):
    with TierRegistry(tier_config) as reg:
        reg.put("a", torch.ones(4 * 1024 * 1024), tier="nvme")  # 16 MiB
        with pytest.raises(NvmePoolFullError, match="nvme_pool.size"):
            for i in range(10):
                reg.put(f"b{i}", torch.ones(4 * 1024 * 1024), tier="nvme")
        used = reg.nvme_pool.used_bytes
        with pytest.raises(NvmePoolFullError):
            reg.put("a", torch.zeros(16 * 1024 * 1024), tier="nvme")
        assert torch.equal(reg.get("a"), torch.ones(4 * 1024 * 1024))
        assert reg.nvme_pool.used_bytes == used


@pytest.mark.parametrize("key,message", [
    ("", "cannot be empty"),
    ("a\x00b", "NUL"),
    ("x" * 1025, "longer than 1024"),
    (42, "must be a string"),
])
def test_bad_keys_get_clear_errors(tier_config, key, message):
    with TierRegistry(tier_config) as reg:
        with pytest.raises(InvalidArgumentError, match=message):
            reg.put(key, torch.ones(3))


def test_path_like_keys_are_opaque(tier_config):
    with TierRegistry(tier_config) as reg:
        for key in ["../../etc/passwd", "/abs/path", "a/../../b", "..", "con:nul", "ключ/🙂"]:
            reg.put(key, torch.arange(5), tier="nvme")
            assert torch.equal(reg.get(key), torch.arange(5))
        for d in tier_config.nvme_pool.paths:
            assert sorted(os.listdir(d)) == sorted([DATA_FILE, LOCK_FILE])  # none named by a key


def test_unknown_keys_and_bad_tiers(tier_config):
    with TierRegistry(tier_config) as reg:
        with pytest.raises(KeyNotFoundError, match="no tensor is stored under key 'nope'"):
            reg.get("nope")
        with pytest.raises(InvalidArgumentError, match="unknown tier"):
            reg.put("k", torch.ones(2), tier="gpu")
        with pytest.raises(InvalidArgumentError, match="unsupported dtype"):
            reg.put("k", torch.ones(2, dtype=torch.complex64))


def test_empty_and_scalar_tensors(tier_config):
    with TierRegistry(tier_config) as reg:
        for tier in ("cpu", "nvme"):
            reg.put(f"empty-{tier}", torch.empty(0, 5), tier=tier)
            reg.put(f"scalar-{tier}", torch.tensor(3.5), tier=tier)
            assert reg.get(f"empty-{tier}").shape == (0, 5)
            assert reg.get(f"scalar-{tier}").item() == 3.5


def test_cpu_pool_on_hugetlbfs_spills_and_verifies_like_any_other(tier_config, hugetlbfs):
    tier_config.cpu_pool.shm_dir = str(hugetlbfs)
    tier_config.cpu_pool.size = 9 * 1024 * 1024  # not a whole number of huge pages
    with TierRegistry(tier_config) as reg:
        assert reg.cpu_pool.page_size == 2 << 20
        assert all(a.size % (2 << 20) == 0 for a in reg.cpu_pool.arenas)
        assert reg.cpu_pool.capacity <= tier_config.cpu_pool.size
        # 20 tensors of 0.4-1.6 MB (odd sizes: tails are staged) overflow the 8 MiB pool.
        tensors = {f"t{i}": random_tensor(i).flatten().repeat(400_000 // random_tensor(i).numel() + 1)
                   for i in range(20)}
        assert sum(v.numel() * v.element_size() for v in tensors.values()) > 2 * 8 * 1024 * 1024
        for k, v in tensors.items():
            reg.put(k, v, tier="cpu")
        for k, v in tensors.items():
            info, buf = reg.fetch(k)
            assert bit_equal(tensor_view(reg, info, buf), v)
            reg.release(k)
        stats = reg.nvme_pool.engine.stats
        assert stats.bytes_written > 0 and stats.bytes_read > 0  # it really spilled
        # Corruption is caught, and the failed fetch gives its buffer back.
        reg.evict("t3")
        extent = reg.records.find("t3").nvme
        drive, stripe = extent.stripes[0]
        with open(os.path.join(tier_config.nvme_pool.paths[drive], DATA_FILE), "r+b") as f:
            f.seek(stripe.offset + extent.header + 5)
            b = f.read(1)
            f.seek(stripe.offset + extent.header + 5)
            f.write(bytes([b[0] ^ 0x80]))
        with pytest.raises(DataCorruptionError):
            reg.fetch("t3")
        assert not reg.info("t3").in_cpu
        assert reg.cpu_pool.used_bytes == cpu_bytes_held(reg)  # the failed buffer went back
        assert stats.checksum_failures == 1


def test_failed_manifest_commit_frees_the_new_extent_once(tier_config, monkeypatch):
    """Fault injection: the manifest write fails after the data was written."""
    with TierRegistry(tier_config) as reg:
        reg.put("victim", torch.arange(300_000), tier="nvme")
        used = reg.nvme_pool.used_bytes

        def broken_commit(entry):
            raise OSError("database or disk is full")

        monkeypatch.setattr(reg.durable.manifest, "commit", broken_commit)
        with pytest.raises(OSError, match="disk is full"):
            reg.put("k", torch.ones(300_000), tier="cpu", durable=True)
        monkeypatch.undo()
        assert reg.nvme_pool.used_bytes == used  # the new extent went back, exactly once
        assert reg.cpu_pool.used_bytes == 0
        reg.put("next", torch.zeros(300_000), tier="nvme")  # may reuse that extent...
        assert torch.equal(reg.get("victim"), torch.arange(300_000))  # ...never another's


def test_empty_cpu_tensors_never_become_eviction_victims(tier_config):
    with TierRegistry(tier_config) as reg:
        reg.put("empty", torch.empty(0), tier="cpu")
        reg.fetch("empty")
        reg.release("empty")
        for i in range(12):  # overflow the 8 MiB pool: evictions must skip "empty"
            reg.put(f"t{i}", torch.full((256 * 1024,), float(i)), tier="cpu")
        assert reg.get("empty").shape == (0,)
        assert torch.equal(reg.get("t0"), torch.full((256 * 1024,), 0.0))


def test_a_failed_eviction_leaves_the_tensor_evictable(tier_config):
    tier_config.nvme_pool.size = 2 * (1024 * 1024 + 4096)  # two 1 MiB tensors, each with its header page
    tier_config.nvme_pool.paths = tier_config.nvme_pool.paths[:1]
    with TierRegistry(tier_config) as reg:
        for i in range(8):
            reg.put(f"t{i}", torch.full((256 * 1024,), float(i)), tier="cpu")
        reg.put("n0", torch.zeros(256 * 1024), tier="nvme")
        reg.put("n1", torch.zeros(256 * 1024), tier="nvme")
        with pytest.raises(NvmePoolFullError):  # eviction cannot write its victim anywhere
            reg.put("more", torch.ones(256 * 1024), tier="cpu")
        reg.delete("n0")
        reg.delete("n1")
        reg.put("more", torch.ones(256 * 1024), tier="cpu")  # now the victim can go
        for i in range(8):
            assert torch.equal(reg.get(f"t{i}"), torch.full((256 * 1024,), float(i)))


def test_versions_are_never_reused_across_restarts(tier_config):
    with TierRegistry(tier_config) as reg:
        volatile = reg.put("v", torch.ones(3), tier="cpu").version
    with TierRegistry(tier_config) as reg:
        assert reg.put("v", torch.ones(3), tier="cpu").version > volatile


def test_eviction_picks_the_tensor_needed_furthest_in_the_future(tier_config):
    """With a known cyclic order, the victim is the one whose next use is furthest away
    (for a sweep, the one just used), not the least recently used one."""
    with TierRegistry(tier_config) as reg:
        keys = [f"layer{i}" for i in range(8)]
        reg.spill.set_access_order(keys)
        for k in keys:
            reg.put(k, torch.zeros(256 * 1024), tier="nvme")
        for k in keys:  # a sweep over all 8 x 1 MiB fills the 8 MiB pool
            reg.fetch(k)
            reg.release(k)
        reg.put("other", torch.zeros(256 * 1024), tier="cpu")  # needs one eviction
        # From the cursor (after layer7) the next uses are layer0, 1, ..., 7: layer7 is
        # needed last. LRU would have evicted layer0, the next one needed.
        assert {k for k in keys if not reg.info(k).in_cpu} == {"layer7"}


def test_eviction_follows_an_order_that_names_each_layer_twice(tier_config):
    """A training step loads layers 0..7 forward then 7..0 backward: after the forward,
    layer7 comes back next and layer0 last, so layer0 is the one to evict."""
    with TierRegistry(tier_config) as reg:
        keys = [f"layer{i}" for i in range(8)]
        reg.spill.set_access_order(keys + keys[::-1])
        for k in keys:
            reg.put(k, torch.zeros(256 * 1024), tier="nvme")
        for k in keys:  # the forward fills the 8 MiB pool
            reg.fetch(k)
            reg.release(k)
        reg.put("other", torch.zeros(256 * 1024), tier="cpu")
        assert {k for k in keys if not reg.info(k).in_cpu} == {"layer0"}
        for k in keys[::-1][:4]:  # backward through 7..4: the cursor follows the second visits
            reg.fetch(k)
            reg.release(k)
        reg.put("other2", torch.zeros(512 * 1024), tier="cpu")  # 2 MiB: two evictions
        # "other" goes first (outside the order: never needed). Then: next come 3, 2, 1,
        # then the next forward 0, 1, ... 7: layer7's next use is the furthest.
        assert not reg.info("layer7").in_cpu and reg.info("layer3").in_cpu


def test_without_an_order_eviction_is_least_recently_used(tier_config):
    with TierRegistry(tier_config) as reg:
        for i in range(8):  # 8 x 1 MiB fill the 8 MiB pool
            reg.put(f"t{i}", torch.zeros(256 * 1024), tier="nvme")
            reg.fetch(f"t{i}")
            reg.release(f"t{i}")
        reg.fetch("t0")  # t0 becomes the most recently used
        reg.release("t0")
        reg.put("other", torch.zeros(256 * 1024), tier="cpu")
        assert {k for k in reg.keys() if k.startswith("t") and not reg.info(k).in_cpu} == {"t1"}


def test_a_full_pool_evicts_what_the_schedulers_plan_puts_on_nvme(tier_config):
    """The plan streams the odd layers from NVMe: they are the ones evicted, although the
    access order alone would evict the layers used furthest ahead and LRU the oldest."""
    with TierRegistry(tier_config) as reg:
        keys = [f"job/layer{i}/params" for i in range(8)]
        reg.spill.set_access_order(keys)
        for k in keys:
            reg.put(k, torch.full((256 * 1024,), float(keys.index(k))), tier="nvme")
        for k in keys:  # a sweep over all 8 x 1 MiB fills the 8 MiB pool
            reg.fetch(k)
            reg.release(k)
        tiers = {k: "nvme" if i % 2 else "cpu" for i, k in enumerate(keys)}
        reg.spill.apply_plan(JobPlan("job", 3, tiers, reason="trace"))
        for i in range(4):  # four more 1 MiB tensors: four evictions
            reg.put(f"job/other{i}", torch.zeros(256 * 1024), tier="cpu")
        assert [k for k in keys if not reg.info(k).in_cpu] == keys[1::2]
        [plan] = reg.spill.eviction_state().plans
        assert (plan.job, plan.version, plan.tensor_keys) == ("job", 3, 8)

        # Forgotten, the plan no longer protects the even layers: the access order decides
        # again. Refill the pool with every layer, layer6 used last: it is needed furthest
        # ahead, so it goes (with the plan, an odd layer would have).
        reg.spill.forget_plan("job")
        assert reg.spill.eviction_state().plans == []
        for i in range(4):
            reg.delete(f"job/other{i}")
        for k in keys[1::2] + [keys[6]]:
            reg.fetch(k)
            reg.release(k)
        reg.put("job/more", torch.zeros(256 * 1024), tier="cpu")
        assert [k for k in keys if not reg.info(k).in_cpu] == [keys[6]]
        for i, k in enumerate(keys):
            assert torch.equal(reg.get(k), torch.full((256 * 1024,), float(i)))


def test_a_plan_keeping_everything_in_the_cpu_pool_is_a_preference_not_a_pin(tier_config):
    """Unlike a user's "cpu" placement, the plan's CPU tier yields when nothing else can."""
    with TierRegistry(tier_config) as reg:
        keys = [f"job/t{i}" for i in range(8)]
        for k in keys:
            reg.put(k, torch.zeros(256 * 1024), tier="cpu")
        reg.spill.apply_plan(JobPlan("job", 1, {k: "cpu" for k in keys}, eviction_order=keys[::-1]))
        reg.put("job/more", torch.ones(256 * 1024), tier="cpu")  # fits only by evicting
        # Every key ranks the same: the plan's eviction order names job/t7 first.
        assert [k for k in keys if not reg.info(k).in_cpu] == ["job/t7"]


def test_a_full_nvme_pool_drops_nvme_copies_of_cpu_resident_tensors(tier_config):
    """Evicted, fetched back, then the disk fills: the clean NVMe copy of a CPU-resident,
    non-durable tensor is given up to make room, and nothing is lost."""
    tier_config.nvme_pool.size = 6 * 256 << 10  # room for one 1 MiB tensor, not two
    tier_config.nvme_pool.paths = tier_config.nvme_pool.paths[:1]
    with TierRegistry(tier_config) as reg:
        a = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB each
        reg.put("a", a, tier="cpu")
        reg.evict("a")
        reg.fetch("a")
        reg.release("a")  # in both tiers now: a clean cached copy
        assert reg.info("a").on_nvme and reg.info("a").in_cpu
        b = a + 1
        reg.put("b", b, tier="cpu")
        reg.evict("b")  # needs the room a's NVMe copy held
        assert reg.info("b").on_nvme and not reg.info("a").on_nvme
        assert torch.equal(reg.get("a"), a) and torch.equal(reg.get("b"), b)
        durable = reg.put("c", a[:1 << 16], tier="nvme")  # durable copies are never dropped
        assert durable.on_nvme and torch.equal(reg.get("c"), a[:1 << 16])


def _settled(reg: TierRegistry, key: str, in_cpu: bool, seconds: float = 10.0):
    """The tensor's info once its CPU residency is `in_cpu` (the send-out is asynchronous)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        info = reg.info(key)
        if info.in_cpu == in_cpu and reg.spill.pending_send_outs() == 0:
            return info
        time.sleep(0.01)
    raise AssertionError(f"{key}: in_cpu still {reg.info(key).in_cpu} after {seconds} s")


def test_tensors_placed_nvme_leave_the_cpu_pool_between_uses_though_it_has_room(tier_config):
    """DeepSpeed's max_in_cpu 0: a tensor placed "nvme" is written out and its CPU copy
    dropped as soon as nobody holds it; a fetch brings it back for the use; a read-ahead
    keeps it until it is used; "auto" tensors stay while the pool has room."""
    with TierRegistry(tier_config) as reg:
        x, y = random_tensor(11), random_tensor(12)
        reg.put("job/placed", x, tier="cpu", placement="nvme")
        reg.put("job/free", y, tier="cpu", placement="auto")
        info = _settled(reg, "job/placed", in_cpu=False)
        assert info.on_nvme and reg.info("job/free").in_cpu
        assert bit_equal(reg.get("job/placed"), x)

        fetched, buffer = reg.fetch("job/placed")  # a use: in the pool while held
        assert reg.info("job/placed").in_cpu and bit_equal(tensor_view(reg, fetched, buffer), x)
        time.sleep(0.2)
        assert reg.info("job/placed").in_cpu  # never taken from under a reader
        reg.release("job/placed", fetched.version)
        _settled(reg, "job/placed", in_cpu=False)

        reg.leases.read_ahead("job/placed")  # a prefetch hint: stays until its use
        time.sleep(0.2)
        assert reg.info("job/placed").in_cpu and reg.spill.pending_send_outs() == 0
        fetched, _ = reg.fetch("job/placed")
        reg.release("job/placed", fetched.version)
        _settled(reg, "job/placed", in_cpu=False)

        claim = reg.updates.claim(["job/placed"])
        info, buffer = reg.updates.begin(claim, "job/placed")  # a new version goes out too
        reg.view(buffer)[:1] = b"\x07"
        new = reg.updates.end(claim, info, changed=True)
        assert new.version != info.version
        assert _settled(reg, "job/placed", in_cpu=False).on_nvme
        assert bytes(reg.get("job/placed").contiguous().view(torch.uint8).flatten().numpy()[:1]) == b"\x07"
