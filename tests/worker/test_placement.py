"""Budgets in, placement out: the engine measures one step and places what fits the HBM
budget on the device (resident blocks, kept activations), and trains exactly as plain
PyTorch does whatever it placed (fp32, same seed and data, a real daemon)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.worker.test_engine_tiers import HYPER, _data, _plain_losses, _train_config
from tests.worker.test_offload import TinyGPT
from tierstack.budgets import Budgets
from tierstack.errors import ConfigError
from tierstack.worker.engine.offload_engine import OffloadEngine, check_capacity, training_state_bytes
from tierstack.worker.store.layer_store import LayerStore
from tierstack.worker.engine.placement import (MARGIN_FRACTION, DeviceFootprint, check_policy_fits,
                                        place_blocks, under_policy)

MiB = 1 << 20


@pytest.fixture
def daemon(shared_daemon):
    """One daemon for this module: every test uses only its own jobs (conftest.shared_daemon)."""
    return shared_daemon


def _budgets(hbm: int) -> Budgets:
    return Budgets(hbm=hbm, host=8 << 30, nvme=8 << 30)


def test_place_blocks_fills_the_budget_with_whole_blocks_then_activations():
    footprint = DeviceFootprint(peak=100 * MiB, block_state=(40 * MiB,) * 6,
                                block_layer=(10 * MiB,) * 6, block_activations=(20 * MiB,) * 6)
    # 150 MiB past the probe: three whole blocks (40 MiB each, the edges first), then the
    # activations of one of them (20 MiB); the rest is recomputed.
    p = place_blocks(footprint, 105 * MiB + 150 * MiB, [True] * 6, window_layers=3)
    assert p.resident == (0, 1, 5) and p.keep_activations == (0,)
    assert p.layer_budget == 3 * 10 * MiB and p.planned_peak <= 255 * MiB
    # Offloaded blocks keep activations after the resident ones, holding their layer too.
    only_first = [True] + [False] * 5
    q = place_blocks(footprint, 105 * MiB + 40 * MiB + 20 * MiB + 30 * MiB, only_first, window_layers=3)
    assert q.resident == (0,) and q.keep_activations == (0, 1)
    assert q.layer_budget == (3 + 1) * 10 * MiB
    # Blocks a constraint pins to the host may keep their activations, never move in.
    pinned = place_blocks(footprint, 300 * MiB, [False] * 6, window_layers=3)
    assert pinned.resident == () and len(pinned.keep_activations) == 6
    # A budget below the probe's own footprint names the smallest one that would do.
    with pytest.raises(ConfigError, match=r"budgets.hbm is 90 MiB .* raise budgets.hbm to at least 105 MiB"):
        place_blocks(footprint, 90 * MiB, [True] * 6, window_layers=3)


def test_an_explicit_activation_policy_is_what_the_placement_reports():
    """train.activations.policy overrides auto's choice of what keeps its activations and
    whose input leaves the device; the probe ran in that policy, so the planned peak is
    the probe's (with the margin) plus the resident blocks' state."""
    footprint = DeviceFootprint(peak=100 * MiB, block_state=(40 * MiB,) * 4,
                                block_layer=(10 * MiB,) * 4, block_activations=(20 * MiB,) * 4,
                                block_inputs=(2 * MiB,) * 4)
    # Room for block 0 whole (40), its activations (20) and one offloaded block's (20 + 10).
    auto = place_blocks(footprint, 105 * MiB + 40 * MiB + 20 * MiB + 30 * MiB, [True] + [False] * 3,
                        window_layers=2)
    assert auto.resident == (0,) and auto.keep_activations == (0, 1)
    planned = int(100 * MiB * (1 + MARGIN_FRACTION)) + 40 * MiB
    for policy, keep, offload in [("keep", (0, 1, 2, 3), ()), ("recompute", (), ()),
                                  ("cpu", (), (1, 2, 3)), ("nvme", (), (1, 2, 3))]:
        p = under_policy(auto, footprint, policy)
        assert (p.resident, p.keep_activations, p.offload_inputs) == ((0,), keep, offload), policy
        assert p.planned_peak == planned and p.layer_budget == auto.layer_budget
    # A probe in the policy over the budget is refused, naming the policy and what to do
    # (auto would send inputs out instead).
    check_policy_fits(footprint, 105 * MiB, "keep")
    with pytest.raises(ConfigError, match=r"policy 'keep': one step needs 105 MiB .* budgets.hbm is "
                                          r"104 MiB; set the policy to 'auto'"):
        check_policy_fits(footprint, 104 * MiB, "keep")


@pytest.mark.parametrize("policy", ["keep", "recompute", "cpu"])
def test_a_placed_engine_runs_and_reports_the_configured_activation_policy(daemon, policy):
    """With an HBM budget that holds the probe's footprint (in the policy) and one block
    more, a block is made resident and the policy applies to every block: the engine
    trains like plain PyTorch and reports what ran; a budget below the probe's footprint
    is refused before any step."""
    torch.manual_seed(0)
    reference = TinyGPT(dim=64, layers=4)
    batches = _data(7, 3)
    expected = _plain_losses(copy.deepcopy(reference), batches)
    activations = {"policy": policy}
    hbm = _one_block_more(daemon, batches, activations=activations)
    got, placement, left, _ = _engine_run(daemon, f"place-{policy}", hbm, batches,
                                          params={"device": "auto"}, activations=activations)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
    assert len(placement.resident) == 1 and left == [] and placement.planned_peak <= hbm
    offloaded = tuple(i for i in range(4) if i not in placement.resident)
    assert placement.keep_activations == ((0, 1, 2, 3) if policy == "keep" else ())
    assert placement.offload_inputs == (offloaded if policy == "cpu" else ())
    with pytest.raises(ConfigError, match=rf"policy '{policy}': one step needs"):
        _engine_run(daemon, f"place-{policy}-small", hbm // 4, batches, params={"device": "auto"},
                    activations=activations)


def _engine_run(daemon, job: str, hbm: int, batches, **train):
    torch.manual_seed(0)
    model = TinyGPT(dim=64, layers=4)
    store = LayerStore(job, device="cpu", device_budget=64 << 20, address=daemon.address,
                       durable=False)
    try:
        engine = OffloadEngine(model, store, _train_config(**train), budgets=_budgets(hbm))
        try:  # closed when a step raises too: its AdamW threads end with it
            losses = [engine.train_step(x, y) for x, y in batches]
            return losses, engine.placement, store.resident_layers(), store.tiers.stats().tensors
        finally:
            engine.close()
    finally:
        store.close()


@pytest.mark.parametrize("room, resident, kept", [
    ("all", 4, 4),        # everything fits: every block resident, every activation kept
    ("one", 1, None),     # room for one whole block and a half: one resident
    ("none", 0, 0),       # no HBM budget: the safe placement (streamed, recomputed)
])
def test_any_placement_trains_like_plain_pytorch(daemon, room, resident, kept):
    torch.manual_seed(0)
    reference = TinyGPT(dim=64, layers=4)
    batches = _data(5, 4)
    expected = _plain_losses(copy.deepcopy(reference), batches)
    hbm = {"all": 1 << 40, "none": 0}[room] if room != "one" else _one_block_more(daemon, batches)
    got, placement, left, _ = _engine_run(daemon, f"place-{room}", hbm, batches,
                                          params={"device": "auto"})
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
    assert left == []  # nothing stays on the device between steps but resident blocks
    if room == "none":
        assert placement is None
        return
    assert len(placement.resident) == resident
    if kept is not None:
        assert len(placement.keep_activations) == kept


def _one_block_more(daemon, batches, **train) -> int:
    """An HBM budget with room for the probe's footprint and one and a half blocks' state."""
    torch.manual_seed(0)
    model = TinyGPT(dim=64, layers=4)
    store = LayerStore("measure", device="cpu", device_budget=64 << 20, address=daemon.address,
                       durable=False)
    try:
        engine = OffloadEngine(model, store, _train_config(params={"device": "cpu"}, **train))
        footprint = engine._probe(lambda: engine._loss(*batches[0]))
        engine.close()
    finally:
        store.close()
    return int(footprint.peak * 1.05) + footprint.block_state[0] * 3 // 2


def test_pinned_blocks_keep_their_activations_and_stay_offloaded(daemon):
    """A config that pins the parameters to the CPU pool (DeepSpeed's offload_param cpu):
    no block moves to the device, every block keeps its activations (no recompute)."""
    torch.manual_seed(0)
    reference = TinyGPT(dim=64, layers=4)
    batches = _data(6, 3)
    expected = _plain_losses(copy.deepcopy(reference), batches)
    got, placement, left, tensors = _engine_run(daemon, "pinned", 1 << 40, batches,
                                                params={"device": "cpu"})
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
    assert placement.resident == () and placement.keep_activations == (0, 1, 2, 3)
    assert left == [] and tensors > 0


def test_resident_blocks_leave_the_tier_manager(daemon):
    torch.manual_seed(0)
    model = TinyGPT(dim=64, layers=4)
    store = LayerStore("resident", device="cpu", device_budget=64 << 20, address=daemon.address,
                       durable=False)
    try:
        engine = OffloadEngine(model, store, _train_config(params={"device": "auto"}),
                                           budgets=_budgets(1 << 40))
        for x, y in _data(7, 2):
            engine.train_step(x, y)
        assert engine.placement.resident == (0, 1, 2, 3)
        keys = [k for k in (store.key(i, kind) for i in range(4)
                            for kind in ("params", "grad", "exp_avg", "exp_avg_sq"))]
        for key in keys:
            with pytest.raises(Exception, match="no tensor is stored"):
                store.client.describe(key)
        assert all(isinstance(b, torch.nn.Module) and not type(b).__name__.startswith("_")
                   for b in model.blocks)
        engine.close()
    finally:
        store.close()


def test_a_block_moved_in_after_steps_brings_its_masters_and_moments(daemon):
    """bf16 with fp32 masters: two steps with every block offloaded, then a placement
    that moves every block to the device; the device AdamW continues from the moments
    the tier manager kept, step for step as the engine that never moved them."""
    torch.manual_seed(0)
    batches = _data(8, 4)

    def run(job: str, move_after: int | None):
        torch.manual_seed(0)
        model = TinyGPT(dim=64, layers=3)
        store = LayerStore(job, device="cpu", device_budget=64 << 20, address=daemon.address,
                           durable=False)
        try:
            engine = OffloadEngine(
                model, store, _train_config(precision="bf16", params={"device": "auto"}),
                budgets=_budgets(0))
            losses = []
            for step, (x, y) in enumerate(batches):
                if step == move_after:
                    engine.budgets = _budgets(1 << 40)
                    engine.place(x, y)
                    assert engine.placement.resident == (0, 1, 2)
                losses.append(engine.train_step(x, y))
            engine.close()
            return losses
        finally:
            store.close()

    torch.testing.assert_close(torch.tensor(run("moved", 2)), torch.tensor(run("stayed", None)),
                               rtol=0, atol=0)


def test_a_model_larger_than_every_budget_is_refused_before_anything_is_stored(daemon):
    """The daemon of this test has a 16 MiB CPU pool and a 256 MiB NVMe pool: a model of
    ~25 M parameters (~400 MB of training state) cannot fit, and nothing is written."""
    model = TinyGPT(dim=512, layers=8, vocab=4096)
    store = LayerStore("too-big", device="cpu", address=daemon.address, durable=False)
    try:
        before = store.tiers.stats().tensors
        with pytest.raises(ConfigError, match=r"training state needs .* GiB \(with .* GiB of room for "
                                              r"a streamed block's step\) but the budgets hold "
                                              r".* raise budgets.nvme \(tier_manager.nvme_pool.size\) "
                                              r"to at least"):
            OffloadEngine(model, store, _train_config(params={"device": "cpu"}),
                                      budgets=_budgets(0))
        assert store.tiers.stats().tensors == before
    finally:
        store.close()


def test_budgets_that_hold_the_state_but_no_room_for_a_streamed_step_are_refused(daemon):
    """A streamed block's step writes its new parameters and moments before it frees the
    old: budgets holding the state with less room than that for the largest block fail
    at the first step on a full pool (a 19e9-parameter job on the H200 did), so they are
    refused up front; with the room they are not."""
    model = TinyGPT(dim=512, layers=8, vocab=4096)
    state = training_state_bytes(model, "fp32")
    largest = max(sum(p.numel() for p in b.parameters()) for b in model.blocks)
    working = 2 * largest * 12  # two blocks' new fp32 parameters and moments
    store = LayerStore("no-room", device="cpu", address=daemon.address, durable=False)
    try:
        node = store.tiers.node()
        pools = node.cpu_capacity + node.nvme_capacity
        with pytest.raises(ConfigError, match=r"room for a streamed block's step"):
            check_capacity(model, "fp32", state - pools + working // 2, node, largest)
        check_capacity(model, "fp32", state - pools + working, node, largest)
        check_capacity(model, "fp32", state - pools, node)  # no block streamed, no room needed
    finally:
        store.close()


def test_a_bf16_model_s_masters_wait_for_the_placement(daemon):
    """A model built in bf16 keeps no fp32 masters in the CPU pool before the placement:
    resident blocks widen theirs on the device, blocks left offloaded get them stored
    after the placement, and both train as the engine that stored them at once. The
    placement's probe stores no gradients either."""
    batches = _data(9, 4)

    def run(job: str, hbm: int, params_device: str):
        torch.manual_seed(0)
        model = TinyGPT(dim=64, layers=3).to(torch.bfloat16)
        store = LayerStore(job, device="cpu", device_budget=64 << 20, address=daemon.address,
                           durable=False)
        try:
            before = store.tiers.stats().cpu_used  # the daemon serves other tests' jobs too
            engine = OffloadEngine(
                model, store, _train_config(precision="bf16", params={"device": params_device}),
                budgets=_budgets(hbm))
            registered = store.tiers.stats().cpu_used - before
            engine._probe(lambda: engine._loss(*batches[0]))
            after_probe = store.tiers.stats().cpu_used - before
            losses = [engine.train_step(x, y) for x, y in batches]
            engine.close()
            return losses, registered, after_probe, engine.placement
        finally:
            store.close()

    stored, stored_bytes, _, _ = run("masters-at-once", 0, "cpu")  # no HBM budget: no placement
    offloaded, deferred_bytes, probed_bytes, placement = run("masters-after", 1 << 40, "cpu")
    assert placement.resident == ()
    # bf16 parameters alone (2 bytes per parameter) against parameters and masters (2 + 4).
    assert deferred_bytes * 2.5 <= stored_bytes, (deferred_bytes, stored_bytes)
    assert probed_bytes == deferred_bytes  # the probe's gradients were never stored
    assert offloaded == stored  # the same daemon AdamW from the same masters, bit for bit
    resident, resident_bytes, _, placement = run("masters-on-device", 1 << 40, "auto")
    assert placement.resident == (0, 1, 2) and resident_bytes == deferred_bytes
    # The device's AdamW against the daemon's: equal to within a few bf16 roundings.
    torch.testing.assert_close(torch.tensor(resident), torch.tensor(stored), rtol=2e-3, atol=0)


def test_the_probe_counts_the_persistent_moments_its_first_step_has_not_made_yet():
    """The probe runs before any optimizer step: the moments of the parameters that stay on
    the device appear only after it, and every later step holds them (8 bytes/param)."""
    from tierstack.worker.engine.offload_engine import pending_moment_bytes

    params = [torch.nn.Parameter(torch.zeros(10, 3)), torch.nn.Parameter(torch.zeros(5))]
    opt = torch.optim.AdamW(params)
    assert pending_moment_bytes(opt, params) == 2 * 4 * 35
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert pending_moment_bytes(opt, params) == 0
    late = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))  # a block made resident later
    opt.add_param_group({"params": [late]})
    assert pending_moment_bytes(opt, params + [late]) == 2 * 2 * 4


def test_resident_bf16_blocks_step_one_group_at_a_time_as_plain_masters_would(daemon):
    """Every block resident in bf16: the device's AdamW widens one param group's gradients
    at a time (the placement has no room for an fp32 copy of every resident gradient), and
    trains as plain PyTorch does with fp32 masters of a bf16 model."""
    batches = _data(4, 3)
    torch.manual_seed(0)
    reference = TinyGPT(dim=64, layers=3).to(torch.bfloat16)
    model = copy.deepcopy(reference)
    masters = [p.detach().float().requires_grad_() for p in reference.parameters()]
    plain = torch.optim.AdamW(masters, fused=True, **HYPER)
    expected = []
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(reference(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        for p, m in zip(reference.parameters(), masters):
            m.grad, p.grad = p.grad.float(), None
        plain.step()
        with torch.no_grad():
            for p, m in zip(reference.parameters(), masters):
                p.copy_(m)
        expected.append(loss.item())
    store = LayerStore("resident-groups", device="cpu", device_budget=64 << 20,
                       address=daemon.address, durable=False)
    try:
        engine = OffloadEngine(model, store, _train_config(precision="bf16"),
                                           budgets=_budgets(1 << 40))
        widened = []  # per optimizer call: how many masters hold an fp32 gradient
        real_step = engine.persistent_optimizer.step
        engine.persistent_optimizer.step = lambda: (widened.append(
            sum(m.grad is not None for m in engine.persistent_masters)), real_step())[1]
        losses = [engine.train_step(x, y) for x, y in batches]
        groups = engine.persistent_optimizer.param_groups
        engine.close()
    finally:
        store.close()
    assert engine.placement.resident == (0, 1, 2) and len(groups) == 4
    sizes = [len(g["params"]) for g in groups]
    assert widened == sizes * 3  # each call: exactly one group's gradients, in fp32
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-6, atol=0)
