"""Which state of each layer a store keeps with its tier manager, and how each is laid out.

A layer's parameters have the layout it was registered with (`LayerLayout`, written
beside it as `<key>/layout`); every other kind of its state (gradients, fp32 masters,
the optimizer's moments) has its own layout, written once as `<key>/<kind>.layout` and
again only when it changes. The catalog also remembers the bytes of each (layer, kind)
stored (what a trace tells the scheduler) and the layers whose state left the tier
manager for good (`forget`). It knows nothing of devices or loads.
"""

from __future__ import annotations

from typing import Callable

import torch

from tierstack.worker.store.layout import LayerLayout
from tierstack.worker.store.tier_session import TierSession


def layout_block(layout: LayerLayout) -> torch.Tensor:
    """A layout's JSON as the bytes stored beside the layer."""
    return torch.frombuffer(bytearray(layout.to_json()), dtype=torch.uint8)


class StateCatalog:
    """The layouts of one job's layers, of every kind, as stored with the daemon."""

    def __init__(self, session: TierSession, key: Callable[[int, str], str]) -> None:
        self._session = session
        self._key = key
        self.layouts: list[LayerLayout] = []
        """Each layer's parameters' layout, by index."""
        self._kinds: dict[tuple[int, str], LayerLayout] = {}
        self.stored_kinds: dict[tuple[int, str], int] = {}
        """(layer, kind) -> bytes of the state of that kind written or declared here."""
        self.forgotten: set[int] = set()
        """Layers whose state left the tier manager (moved to the device for good)."""

    def declare(self, index: int, kind: str, layout: LayerLayout) -> None:
        """Record how layer `index`'s state of `kind` is laid out (written to the daemon
        when it changes: the daemon itself writes the moments, and a reader needs it)."""
        self.stored_kinds[(index, kind)] = layout.nbytes
        if self._kinds.get((index, kind)) != layout:
            self._session.write_block(self._key(index, f"{kind}.layout"), layout_block(layout))
            self._kinds[(index, kind)] = layout

    def layout_for_write(self, index: int, kind: str, tensors) -> LayerLayout:
        """The layout `tensors` of `kind` are written with: the declared one where they fit
        it (whatever their order), else theirs."""
        if kind == "params":
            return self.layouts[index]
        layout = self._kinds.get((index, kind))
        return layout if layout is not None and layout.fits(tensors) else LayerLayout.of(tensors)

    def layout_of(self, index: int, kind: str) -> LayerLayout:
        """How layer `index`'s state of `kind` is laid out (read from the daemon once)."""
        if kind == "params":
            return self.layouts[index]
        layout = self._kinds.get((index, kind))
        if layout is None:
            data = self._session.read_block(self._key(index, f"{kind}.layout"))
            layout = self._kinds[(index, kind)] = LayerLayout.from_json(bytes(data.numpy()))
        return layout

    def forget(self, index: int, kinds) -> list[str]:
        """Drop layer `index` from the catalog (its kinds and `kinds`); the keys to delete."""
        own = {kind for (i, kind) in self.stored_kinds if i == index} | set(kinds)
        keys = [self._key(index, "params"), self._key(index, "layout")]
        keys += [self._key(index, k) for k in sorted(own)]
        keys += [self._key(index, f"{k}.layout") for k in sorted(own)]
        for kind in own:
            self.stored_kinds.pop((index, kind), None)
            self._kinds.pop((index, kind), None)
        self.forgotten.add(index)
        return keys
