"""What of an offloaded model lives on the device: the engine's packing of its HBM budget.

Budgets in, placement out. The engine measures one forward and backward of the model
with the safe placement (every block streamed, none of its activations kept) and packs
the HBM budget with what it measured (`DeviceFootprint`):

1. whole blocks first: a resident block's parameters, gradients and optimizer state stay
   on the device and it steps with the device's AdamW, so it leaves every link (PCIe,
   disk, the CPU optimizer) at once; it is recomputed in backward (only its input kept)
   unless step 2 gives it room;
2. then kept activations, resident blocks first (they cost only their activations): a
   block that keeps them is not recomputed (one forward of that block fewer per step);
   an offloaded one also keeps its parameters on the device from its forward to its
   backward.

When even the probe's footprint is over the budget, no block moves in or keeps its
activations; instead the fewest recomputed blocks' inputs wait for the backward with the
tier manager (worker/engine/activation_stash.py) rather than on the device, the first blocks'
first. An explicit activation policy (train.activations.policy) overrides step 2 and
this: the probe runs in it (what it keeps is in the measured peak), a budget below that
is refused (`check_policy_fits`), and the placement reports what it runs (`under_policy`).

Blocks a constraint pins to a host tier (a DeepSpeed JSON's offload device, a module
override) are never made resident; they may keep their activations. Which host tier an
offloaded tensor lives in (CPU pool or NVMe), and how far ahead it is prefetched, is
the tier manager's and the scheduler's part of the placement (host and NVMe budgets).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tierstack.errors import ConfigError
from tierstack.tiers import HOST_TIERS

MiB = 1 << 20
MARGIN_FRACTION = 0.05
"""Share of the HBM budget left unplanned: the allocator's fragmentation and the
difference between the probe's step and later ones."""


def _planned(peak: int) -> int:
    """A measured peak with the margin: what a placement plans for it."""
    return int(peak * (1 + MARGIN_FRACTION))


@dataclass(frozen=True)
class DeviceFootprint:
    """What the probe step measured on the device."""

    peak: int
    """The most device memory allocated during the probe (every block streamed and
    recomputed): the fixed part every placement pays (persistent state, the blocks'
    saved inputs, the logits, the streamed layers' buffers, one block's recompute)."""
    block_state: tuple[int, ...]
    """Device bytes of each block made resident: its tensors as stored, their gradients,
    and the optimizer's fp32 masters (when the parameters are not fp32) and two moments."""
    block_layer: tuple[int, ...]
    """Bytes of each block's tensors as streamed (held from forward to backward when it
    keeps its activations)."""
    block_activations: tuple[int, ...]
    """Bytes autograd saves in each block's forward (what keeping its activations costs)."""
    block_inputs: tuple[int, ...] = ()
    """Bytes of each block's input, part of the peak while it waits on the device for the
    block's backward (what sending it to the tier manager saves; empty: unknown, 0 each)."""


@dataclass(frozen=True)
class BlockPlacement:
    """The engine's decision for each block."""

    resident: tuple[int, ...]
    keep_activations: tuple[int, ...]
    """Blocks not recomputed in backward, resident or offloaded."""
    layer_budget: int
    """Device bytes the layer store may hold for streamed layers: the prefetch window plus
    the layers kept from forward to backward."""
    planned_peak: int
    """The footprint the placement expects (within the HBM budget)."""
    offload_inputs: tuple[int, ...] = ()
    """Recomputed blocks whose input waits for the backward with the tier manager, not on
    the device (the budget cannot hold every input)."""

    def describe(self, count: int) -> str:
        return (f"{len(self.resident)} of {count} blocks resident on the device, "
                f"{len(self.keep_activations)} blocks keep their activations, "
                f"{count - len(self.keep_activations)} recomputed, "
                f"{len(self.offload_inputs)} of them from an input kept by the tier manager; "
                f"planned peak {self.planned_peak / MiB:,.0f} MiB")


def _edges_first(indices: list[int]) -> list[int]:
    """Blocks from both ends inwards: the first forward layers and the first backward
    ones (the model's last) have no compute before them to hide a transfer behind."""
    out, lo, hi = [], 0, len(indices) - 1
    while lo <= hi:
        out.append(indices[lo])
        if hi != lo:
            out.append(indices[hi])
        lo, hi = lo + 1, hi - 1
    return out


def place_blocks(footprint: DeviceFootprint, hbm_budget: int, may_be_resident: list[bool],
                 window_layers: int) -> BlockPlacement:
    """Pack `hbm_budget` with resident blocks, then kept activations (module docstring).

    `window_layers`: streamed layers on the device at once (the prefetch window and the
    one in use), already part of the probe's peak. Raises, naming the smallest budget
    that would do, when the budget cannot hold even the probe's footprint.
    """
    count = len(footprint.block_state)
    planned = _planned(footprint.peak)
    if planned > hbm_budget:
        return _offloading_inputs(footprint, hbm_budget, window_layers)
    free = hbm_budget - planned
    resident: list[int] = []
    for i in _edges_first([i for i in range(count) if may_be_resident[i]]):
        if footprint.block_state[i] <= free:
            resident.append(i)
            free -= footprint.block_state[i]
    kept: list[int] = []
    offloaded = [i for i in range(count) if i not in resident]
    for i in _edges_first(sorted(resident)) + _edges_first(offloaded):
        cost = footprint.block_activations[i] + (0 if i in resident else footprint.block_layer[i])
        if cost <= free:
            kept.append(i)
            free -= cost
    streamed = [footprint.block_layer[i] for i in offloaded]
    biggest = max(streamed, default=0)
    held = len([i for i in kept if i not in resident])
    layer_budget = max(biggest, (window_layers + held) * biggest)
    return BlockPlacement(tuple(sorted(resident)), tuple(sorted(kept)), layer_budget,
                          hbm_budget - free)


def _offloading_inputs(footprint: DeviceFootprint, hbm_budget: int,
                       window_layers: int) -> BlockPlacement:
    """The placement when even the probe's footprint is over the budget: every block
    streamed and recomputed, and the fewest block inputs sent to the tier manager that
    bring the peak within it, the first blocks' first (their backward comes last, so
    their inputs have the longest to come back). Raises when all of them are not enough."""
    inputs = footprint.block_inputs or (0,) * len(footprint.block_state)
    peak, offloaded = footprint.peak, []
    for i, nbytes in enumerate(inputs):
        if _planned(peak) <= hbm_budget:
            break
        if nbytes:
            peak -= nbytes
            offloaded.append(i)
    planned = _planned(peak)
    if planned > hbm_budget:
        raise ConfigError(
            f"budgets.hbm is {hbm_budget / MiB:,.0f} MiB but one step with every block "
            f"streamed from the host and every block input kept by the tier manager still "
            f"needs {peak / MiB:,.0f} MiB of device memory; raise budgets.hbm to at least "
            f"{planned / MiB:,.0f} MiB, or lower the micro-batch or sequence length")
    layer_budget = window_layers * max(footprint.block_layer, default=0)
    return BlockPlacement((), (), max(layer_budget, 1), planned, tuple(offloaded))


def under_policy(placement: BlockPlacement, footprint: DeviceFootprint, policy: str) -> BlockPlacement:
    """`placement`'s resident blocks under an explicit activation policy
    (train.activations.policy, not "auto"), which the probe ran in: every block keeping its
    activations ("keep") or none ("recompute", "cpu", "nvme"), every offloaded block's
    input with the tier manager ("cpu", "nvme") or none, and the planned peak the probe's
    (what the policy holds, measured) plus the resident blocks' state."""
    count = len(footprint.block_state)
    resident = set(placement.resident)
    keep = tuple(range(count)) if policy == "keep" else ()
    offload = tuple(i for i in range(count) if i not in resident) if policy in HOST_TIERS else ()
    planned = _planned(footprint.peak) + sum(footprint.block_state[i] for i in resident)
    return replace(placement, keep_activations=keep, offload_inputs=offload, planned_peak=planned)


def check_policy_fits(footprint: DeviceFootprint, hbm_budget: int, policy: str) -> None:
    """Raise when the probe's step, run in an explicit activation policy, is over the HBM
    budget: auto would send inputs out or recompute, an explicit policy may not."""
    planned = _planned(footprint.peak)
    if planned > hbm_budget:
        raise ConfigError(
            f"train.activations.policy {policy!r}: one step needs {planned / MiB:,.0f} MiB of device "
            f"memory with what the policy keeps there (measured), but budgets.hbm is "
            f"{hbm_budget / MiB:,.0f} MiB; set the policy to 'auto' (keeps what fits, recomputes or "
            f"offloads the rest), lower the micro-batch or sequence length, or raise budgets.hbm")


class SavedBytes:
    """Counts the bytes autograd saves for backward inside a `with` (each storage once),
    leaving out storages named in `exclude` (a block's own parameters)."""

    def __init__(self, exclude: tuple[int, ...] = ()) -> None:
        import torch

        self.bytes = 0
        self._seen: set[int] = set(exclude)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._seen:
            self._seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()
        return tensor

    def __enter__(self) -> "SavedBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
