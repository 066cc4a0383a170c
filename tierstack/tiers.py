"""The names of the tiers, in one place.

State lives in one of three tiers: the device's memory ("gpu", whatever the device:
on a CPU-only machine the worker's device is the CPU), the node's CPU pool ("cpu"),
or its NVMe pool ("nvme"). What is not pinned to a tier is "auto": the CPU pool keeps
it while it has room, the rest goes to NVMe. DeepSpeed's configs name the device tier
"none" (nothing offloaded); metrics name it "device".
"""

from __future__ import annotations

from typing import Literal

GPU, CPU, NVME, AUTO = "gpu", "cpu", "nvme", "auto"

Tier = Literal["gpu", "cpu", "nvme"]
TIERS: tuple[Tier, ...] = (GPU, CPU, NVME)
"""Where state can live, fastest first."""

BlockTier = Literal["gpu", "cpu", "nvme", "auto"]
BLOCK_TIERS: tuple[BlockTier, ...] = (GPU, CPU, NVME, AUTO)
"""Where an offloaded block's state may be put: a tier, or wherever it fits."""

Placement = Literal["auto", "cpu", "nvme"]
PLACEMENTS: tuple[Placement, ...] = (AUTO, CPU, NVME)
"""What the tier manager keeps a tensor in: "cpu" is never evicted, "nvme" is evicted
first, "auto" in between (the tier manager never holds device memory)."""

HOST_TIERS: tuple[Literal["cpu", "nvme"], ...] = (CPU, NVME)
"""The tier manager's own tiers."""

OFFLOAD_DEVICES: dict[str, BlockTier] = {"none": GPU, "cpu": CPU, "nvme": NVME, "auto": AUTO}
"""Offload `device` names -> block tiers: DeepSpeed's three (which pin a state kind to a
tier), and "auto": wherever the budgets place it (the device when it fits)."""

METRIC_TIERS = ("device", CPU, NVME)
"""The tiers as metrics label them (a worker's device may be a GPU or the CPU)."""

ActivationPolicy = Literal["auto", "keep", "recompute", "cpu", "nvme"]
ACTIVATION_POLICIES: tuple[ActivationPolicy, ...] = ("auto", "keep", "recompute", CPU, NVME)
"""What an offloaded block keeps for its backward: all its activations ("keep", no
recompute), only its input on the device ("recompute"), or only its input, kept by the
tier manager in the CPU pool ("cpu") or NVMe ("nvme") and recomputed from there; "auto":
the HBM budget decides (worker/engine/placement.py)."""
