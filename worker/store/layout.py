"""How one layer's tensors are packed into one contiguous block (plain data, JSON on the wire).

Each tensor starts at a multiple of `SLOT_ALIGNMENT` bytes, so its typed view into the
block (on the host or the device) is aligned for any dtype and for vectorised kernels.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping

import torch

from tierstack.errors import InvalidArgumentError
from tierstack.dtypes import dtype_from_name, dtype_name

SLOT_ALIGNMENT = 256


@dataclass(frozen=True)
class TensorSlot:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class LayerLayout:
    """Where each named tensor of a layer lies in the layer's block of `nbytes` bytes."""

    nbytes: int
    slots: tuple[TensorSlot, ...]

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> "LayerLayout":
        slots, offset = [], 0
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            slots.append(TensorSlot(name, dtype_name(t.dtype), tuple(t.shape), offset, nbytes))
            offset += -(-nbytes // SLOT_ALIGNMENT) * SLOT_ALIGNMENT
        return cls(offset, tuple(slots))

    def views(self, block: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed tensors over a uint8 block laid out by this layout (no copy)."""
        return {s.name: block[s.offset:s.offset + s.nbytes].view(dtype_from_name(s.dtype)).view(s.shape)
                for s in self.slots}

    def pack_into(self, block: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy `tensors` (same names, dtypes and shapes) into `block`."""
        self.check(tensors)
        for name, view in self.views(block).items():
            view.copy_(tensors[name], non_blocking=True)

    def fits(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether `tensors` have exactly this layout's names, dtypes and shapes."""
        try:
            self.check(tensors)
        except InvalidArgumentError:
            return False
        return True

    def check(self, tensors: Mapping[str, torch.Tensor]) -> None:
        names = {s.name for s in self.slots}
        if set(tensors) != names:
            missing, extra = sorted(names - set(tensors)), sorted(set(tensors) - names)
            raise InvalidArgumentError(
                f"layer tensors do not match the registered layout: missing {missing}, "
                f"unexpected {extra}")
        for s in self.slots:
            t = tensors[s.name]
            if tuple(t.shape) != s.shape or dtype_name(t.dtype) != s.dtype:
                raise InvalidArgumentError(
                    f"tensor {s.name!r} is {dtype_name(t.dtype)}{list(t.shape)} but the layer "
                    f"was registered with {s.dtype}{list(s.shape)}")

    def to_json(self) -> bytes:
        return json.dumps({"nbytes": self.nbytes, "slots": [
            [s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in self.slots]}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "LayerLayout":
        obj = json.loads(data)
        return cls(obj["nbytes"], tuple(TensorSlot(n, d, tuple(sh), o, nb)
                                        for n, d, sh, o, nb in obj["slots"]))
