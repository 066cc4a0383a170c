"""How a partitioned layer is laid out: its tensors as one flat array cut into N equal shards.

Each tensor starts at a multiple of `ELEMENT_ALIGNMENT` elements, so its typed view is
aligned for vectorised kernels, and a layer's bf16 parameters and its fp32 masters and
moments share element offsets. A layer holds tensors of one dtype (fp32 or bf16 blocks:
every model the engine trains); a mixed-dtype layer is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from tierstack.dtypes import dtype_from_name, dtype_name
from tierstack.errors import InvalidArgumentError

# 256 bytes in fp32.
ELEMENT_ALIGNMENT = 64


@dataclass(frozen=True)
class FlatSlot:
    name: str
    shape: tuple[int, ...]
    offset: int  # in elements
    numel: int
    trainable: bool
    dtype: str  # the layer's (one dtype per layer)


@dataclass(frozen=True)
class FlatLayout:
    """A layer's tensors as one flat array of `dtype`, cut into `world` shards of `shard_numel`."""

    dtype: str
    slots: tuple[FlatSlot, ...]
    shard_numel: int
    world: int

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor], trainable: set[str], world: int,
           what: str = "layer") -> "FlatLayout":
        dtypes = {dtype_name(t.dtype) for t in tensors.values()}
        if len(dtypes) != 1:
            raise InvalidArgumentError(
                f"{what} mixes dtypes {sorted(dtypes)}: partitioned training splits each "
                f"layer as one flat array of one dtype; cast the model (model.to(dtype)) first")
        slots, offset = [], 0
        for name, t in tensors.items():
            slots.append(FlatSlot(name, tuple(t.shape), offset, t.numel(), name in trainable,
                                  dtype_name(t.dtype)))
            offset += -(-t.numel() // ELEMENT_ALIGNMENT) * ELEMENT_ALIGNMENT
        per_rank = -(-offset // world)
        shard = max(ELEMENT_ALIGNMENT, -(-per_rank // ELEMENT_ALIGNMENT) * ELEMENT_ALIGNMENT)
        return cls(dtypes.pop(), tuple(slots), shard, world)

    @property
    def numel(self) -> int:
        return self.shard_numel * self.world

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the full layer in its dtype (as LayerLayout.nbytes: the engine reads either)."""
        return self.numel * self.torch_dtype.itemsize

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def views(self, flat: torch.Tensor, suffix: str = "", trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """Named tensors over a flat array of this layout (no copy)."""
        return {s.name + suffix: flat[s.offset:s.offset + s.numel].view(s.shape)
                for s in self.slots if s.trainable or not trainable_only}

    def pack(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, device,
             suffix: str = "", require_all: bool = True) -> torch.Tensor:
        """A flat array holding `tensors` (named `<slot><suffix>`); zeros where none is given."""
        known = {s.name + suffix: s for s in self.slots}
        unknown = sorted(set(tensors) - set(known))
        missing = sorted(set(known) - set(tensors))
        if unknown or (require_all and missing):
            raise InvalidArgumentError(
                f"layer tensors do not match the registered layout: missing {missing}, "
                f"unexpected {unknown}")
        flat = torch.zeros(self.numel, dtype=dtype, device=device)
        for name, t in tensors.items():
            s = known[name]
            if tuple(t.shape) != s.shape:
                raise InvalidArgumentError(
                    f"tensor {name!r} has shape {list(t.shape)} but the layer was registered "
                    f"with {list(s.shape)}")
            flat[s.offset:s.offset + s.numel].copy_(t.reshape(-1), non_blocking=True)
        return flat

    def trainable_segments(self, rank: int) -> list[tuple[int, int]]:
        """(start, end) ranges, local to shard `rank`, that hold trainable parameters."""
        return [(start, end) for _, start, end in self.trainable_slices(rank)]

    def trainable_slices(self, rank: int) -> list[tuple[str, int, int]]:
        """(parameter name, start, end) of each trainable parameter's part in shard `rank`,
        local to the shard (a parameter cut by a shard boundary has a part in each)."""
        lo, hi = self.shard_range(rank)
        slices = []
        for s in self.slots:
            start, end = max(lo, s.offset), min(hi, s.offset + s.numel)
            if s.trainable and start < end:
                slices.append((s.name, start - lo, end - lo))
        return slices
