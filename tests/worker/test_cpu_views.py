"""On the CPU device, ensure_layer hands out views of the CPU pool, pinned while in use."""

from __future__ import annotations

import time

import torch

from tierstack.worker.store.layer_store import LayerStore


def _pinned(store: LayerStore, expect: int, timeout: float = 10.0) -> int:
    """The daemon's pinned tensors once they reach `expect` (pins are released from a
    background thread), or their count when `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        pinned = store.tiers.stats().pinned
        if pinned == expect or time.monotonic() > deadline:
            return pinned
        time.sleep(0.02)


def test_a_cpu_layer_is_a_view_of_the_arena_pinned_until_it_is_released(daemon):
    torch.manual_seed(0)
    layers = [{"w": torch.randn(256, 256), "b": torch.randn(256)} for _ in range(4)]
    with LayerStore("views", device="cpu", device_budget=8 << 20, address=daemon.address,
                    durable=False) as store:
        store.register_layers(layers)
        assert _pinned(store, 0) == 0
        store.prefetch(1)  # starts the daemon's read only: a waiting layer holds no pin
        tensors = store.ensure_layer(0)
        assert torch.equal(tensors["w"], layers[0]["w"]) and torch.equal(tensors["b"], layers[0]["b"])
        arenas = [store.session.arenas.view(a.index, 0, a.size) for a in store.tiers.node().arenas]
        inside = [a for a in arenas if a.data_ptr() <= tensors["w"].data_ptr() < a.data_ptr() + a.numel()]
        assert len(inside) == 1  # no copy: the bytes the daemon keeps
        assert _pinned(store, 1) == 1
        store.release_layer(0)
        assert _pinned(store, 0) == 0
        store.release_layer(1)  # prefetched, never used: released without a pin to drop
        # An update written after the release is what the next ensure_layer sees.
        store.write_back(0, {"w": torch.zeros(256, 256), "b": torch.ones(256)})
        again = store.ensure_layer(0)
        assert again["w"].abs().sum() == 0 and torch.equal(again["b"], torch.ones(256))
        store.release_layer(0)
        assert store.figures().device_used == 0 and store.figures().stall_seconds > 0


def test_closing_a_store_releases_the_pins_of_layers_still_in_use(daemon):
    with LayerStore("views-close", device="cpu", device_budget=8 << 20, address=daemon.address,
                    durable=False) as store:
        store.register_layers([{"w": torch.ones(1024)} for _ in range(3)])
        store.ensure_layer(0)
        store.ensure_layer(2)
        watcher = LayerStore("views-watch", device="cpu", address=daemon.address, metrics=False)
    try:
        assert _pinned(watcher, 0) == 0
    finally:
        watcher.close()


def test_a_layer_in_a_graph_survives_writes_to_other_layers_of_its_arena(daemon):
    """A block's buffer is the arena view itself (a parameter keeps its own version
    counter, a buffer does not). Views were slices of one tensor per arena, sharing its
    version counter: another layer's write into the arena during a block's recompute
    failed its backward ("modified by an inplace operation", seen once in the suite)."""
    layers = [{"w": torch.randn(64), "scale": torch.full((64,), 2.0)} for _ in range(3)]
    with LayerStore("views-versions", device="cpu", device_budget=8 << 20, address=daemon.address,
                    durable=False) as store:
        store.register_layers(layers)
        tensors = store.ensure_layer(0)
        other = store.ensure_layer(1)
        x = torch.ones(64, requires_grad=True)
        y = (x * tensors["scale"]).sum()  # the graph saves the buffer (the view)
        arenas = [store.session.arenas.view(a.index, 0, a.size) for a in store.tiers.node().arenas]
        (arena,) = [a for a in arenas if a.data_ptr() <= tensors["scale"].data_ptr() < a.data_ptr() + a.numel()]
        assert arena.data_ptr() <= other["scale"].data_ptr() < arena.data_ptr() + arena.numel()
        with torch.no_grad():  # a write into another view of the same arena
            other["scale"].mul_(3.0)
        y.backward()
        assert torch.equal(x.grad, torch.full((64,), 2.0))
        store.release_layer(0)
        store.release_layer(1)
