"""The offload engine: one training step of a model whose blocks live in the tiers.

Composes the parts: `OffloadedBlocks` (forward/backward with each block brought to the
device just in time), `TieredAdamW` (the blocks' optimizer step, run by the tier manager
over the state it keeps), and a plain AdamW for the parameters that stay on the device
(embeddings, final norm, head, and blocks placed on the "gpu" tier: small or hot).

Where each block's parameters live comes from `block_tiers` (the config's per-module
overrides, else its `params` offload device): "gpu" (not offloaded), "cpu" (kept in the
CPU pool, never evicted), "nvme" (out of the CPU pool between uses), or "auto" (the CPU
pool keeps what fits, the rest goes to NVMe). An offloaded block's other state
(gradients, moments, masters) goes to `state_tiers`: its override, else the
`optimizer_state` device, else with its parameters.

Precision: "fp32" end to end, or "bf16" / "fp16": the model computes in the low precision
(blocks are stored and moved in it, half the bytes), while AdamW updates fp32 master
weights, kept by the tier manager for blocks (kind "master") and on the device for
persistent parameters. fp16 needs its loss scaled (the caller's, worker/engine/loss_scaler.py):
`step(loss_scale)` unscales the gradients and skips a step whose gradients overflowed.

Param groups: `param_groups` (torch-style dicts: params, lr, weight_decay, betas, eps) say
each trainable parameter's hyperparameters; the engine reads them at every step, so a
learning-rate schedule that moves a group's lr moves it for the device's AdamW and the
tier manager's alike (AdamWSegment.group).

Activations: `activation_policy` (train.activations.policy) says what each offloaded block
keeps for its backward: everything ("keep"), its input on the device ("recompute"), its
input with the tier manager ("cpu", "nvme"), or whatever the placement decides ("auto");
with `partition_activations` a partitioned engine spreads the inputs it sends to the tier
manager over the ranks' tier managers (ShardedEngine, worker/engine/partitioned_stash.py).

`train_step` overlaps the optimizer with the backward: each block's AdamW step starts
in the tier manager as soon as its gradients are stored. With gradient clipping the
global norm needs every gradient first, so the blocks are stepped after the backward.
With gradient accumulation it splits the batch into micro-batches whose gradients add
up in one window (the blocks' stored gradients, the persistent parameters' .grad), and
only the last micro-batch's backward may start the blocks' steps.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from tierstack.budgets import Budgets, measure
from tierstack.config import DEVICE_BUDGET_LAYERS, BudgetsConfig, OptimizerConfig, TrainConfig
from tierstack.errors import ConfigError, InvalidArgumentError
from tierstack.module_tiers import ModuleTiers
from tierstack.services.tier_manager.types import NodeInfo
from tierstack.tiers import AUTO, BLOCK_TIERS, CPU, GPU, HOST_TIERS, NVME, BlockTier
from tierstack.worker.engine.chunked_loss import language_model_loss, output_head
from tierstack.worker.store.grad_norm import squared_norm
from tierstack.worker.store.block_store import BlockStore
from tierstack.worker.engine.block_views import is_parked
from tierstack.worker.engine.model_views import ModelViews
from tierstack.worker.engine.offloaded_blocks import OffloadedBlocks
from tierstack.worker.engine.param_groups import group_by_name, param_groups_of
from tierstack.worker.engine.placement import (MiB, BlockPlacement, DeviceFootprint, SavedBytes,
                                        check_policy_fits, place_blocks, under_policy)
from tierstack.worker.engine.tiered_adamw import MOMENTS, TieredAdamW
from tierstack.worker.store.step_phases import NO_PHASES, NoPhases, PhaseClock

log = logging.getLogger(__name__)

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Blocks whose deferred fp32 masters are written at once (_store_deferred_masters).
MASTER_WRITERS = 4


def block_tiers(train: TrainConfig, blocks_attr: str, count: int,
                block_numels: list[int] | None = None) -> list[BlockTier]:
    """Each block's tier by the config: its module's override, else the params device
    ("none": stays on the GPU; "nvme": the CPU pool caches the blocks' parameters between
    uses up to `max_in_cpu` elements, as DeepSpeed's offload_param.max_in_cpu, counted
    over the blocks in order when `block_numels` gives their sizes; the blocks past it
    leave the pool after each use, as all do with max_in_cpu 0; "auto": offloaded at
    first, the budgets decide).

    Parameters on the device with the optimizer state offloaded (DeepSpeed's ZeRO-Offload)
    is a block whose master copy lives on the host: its parameters come to the device at
    its forward (and stay until its backward when the HBM budget allows), its gradients
    go to the host, and the tier manager steps it."""
    overrides = ModuleTiers(train.tier_overrides)
    default = train.params.tier()
    if default == GPU and train.optimizer_state.tier() != GPU:
        log.info("train.params.device is 'none' with train.optimizer_state.device %r: the "
                 "blocks' parameters are brought to the device for each step and their "
                 "optimizer state stays on the host (ZeRO-Offload)", train.optimizer_state.device)
        default = CPU
    overridden = [overrides.tier_for(f"{blocks_attr}.{i}") for i in range(count)]
    tiers = [override or default for override in overridden]
    if train.params.device == NVME and train.params.max_in_cpu and block_numels is not None:
        cached = 0
        for i, (numel, override) in enumerate(zip(block_numels, overridden)):
            if override is None:
                cached += numel
                if cached > train.params.max_in_cpu:
                    tiers[i] = NVME
    return tiers


def may_be_resident(train: TrainConfig, blocks_attr: str, count: int) -> list[bool]:
    """Blocks the budgets may place on the device for good (parameters and optimizer state
    together): those no constraint pins to the host (no module override, the params device
    'auto', the optimizer state not sent to the CPU pool or NVMe)."""
    overrides = ModuleTiers(train.tier_overrides)
    free = train.params.device == AUTO and train.optimizer_state.device in ("none", AUTO)
    return [free and overrides.tier_for(f"{blocks_attr}.{i}") is None for i in range(count)]


def state_tiers(train: TrainConfig, blocks_attr: str, count: int,
                block_numels: list[int] | None = None) -> list[BlockTier]:
    """Each block's tier for its gradients and optimizer state: its module's override
    (all of a module's state), else the optimizer_state device, else ("none") its
    parameters' tier (`block_numels` as for `block_tiers`). A block on the "gpu" tier
    keeps everything on the device."""
    overrides = ModuleTiers(train.tier_overrides)
    device_default = train.optimizer_state.tier()
    tiers: list[BlockTier] = []
    for i, params_tier in enumerate(block_tiers(train, blocks_attr, count, block_numels)):
        override = overrides.tier_for(f"{blocks_attr}.{i}")
        if params_tier == GPU:
            tiers.append(GPU)
        else:
            tiers.append(override or (params_tier if device_default == GPU else device_default))
    return tiers


def _updated_bytes_per_parameter(precision: str, from_masters: bool = False) -> int:
    """Bytes an AdamW step writes per parameter: the parameter in the training dtype
    (none with weights made from the masters), its two fp32 moments, and its fp32 master
    where the parameters are not fp32."""
    itemsize = PRECISIONS[precision].itemsize
    return (0 if from_masters else itemsize) + (4 if itemsize != 4 else 0) + 8


def host_state_bytes(numel: int, precision: str, from_masters: bool) -> int:
    """Bytes the tier manager keeps between steps for `numel` offloaded parameters: 14
    per parameter in bf16 or fp16 (weights, fp32 master, two moments), 12 with the weights
    made from the masters, 12 in fp32 (the weights are the masters). Gradients are not
    counted: each block's are consumed by its update as they arrive."""
    return numel * _updated_bytes_per_parameter(precision, from_masters)


def training_state_bytes(model: torch.nn.Module, precision: str, from_masters: bool = False) -> int:
    """Bytes of a model's training state: what a step updates (parameters, moments,
    masters) and the gradients in the training dtype (16 bytes per parameter either way,
    14 with the weights made from the masters; meta tensors count: nothing needs to exist)."""
    per_parameter = _updated_bytes_per_parameter(precision, from_masters) + PRECISIONS[precision].itemsize
    return sum(p.numel() * per_parameter for p in model.parameters())


def masterless_tensors(block: torch.nn.Module) -> list[str]:
    """The tensors of a block that would have no fp32 master: buffers, frozen and
    non-floating parameters (meta tensors count: nothing needs to exist)."""
    trainable = {n for n, p in block.named_parameters() if p.requires_grad and p.is_floating_point()}
    return [n for n in block.state_dict(keep_vars=True) if n not in trainable]


def weights_from_masters(setting: str, precision: str, numel: int, cpu_pool: int,
                         unsupported: str = "") -> bool:
    """Whether offloaded blocks' weights are made from their masters on the way to the
    device (train.params.weights_from_masters): 'on', 'off', or 'auto': on only where the
    `numel` offloaded parameters' host state does not fit `cpu_pool` bytes at 14 bytes
    per parameter and does at 12. `unsupported`: why this engine cannot ('' if it can);
    'on' is refused with it, 'auto' stays off."""
    if setting == "off" or precision == "fp32":  # fp32 'on' is refused by the config
        return False
    if unsupported:
        if setting == "on":
            raise ConfigError(f"train.params.weights_from_masters 'on': {unsupported}; set it "
                              f"to 'auto' or 'off'")
        return False
    if setting == "on":
        return True
    return (host_state_bytes(numel, precision, False) > cpu_pool
            >= host_state_bytes(numel, precision, True))


def decide_weights_from_masters(model: torch.nn.Module, blocks_attr: str, train: TrainConfig,
                                cpu_capacity: int, tiers: list[str] | None = None,
                                partitioned: bool = False) -> bool:
    """Whether a job's store makes the offloaded blocks' weights from their masters
    (`weights_from_masters` over the blocks the config offloads; meta tensors count):
    decided once, before the store is made (worker/job.py), since it is the store's
    setting. `partitioned`: a multi-rank job, which cannot."""
    block_list = model.get_submodule(blocks_attr)
    numels = [sum(p.numel() for p in block.parameters()) for block in block_list]
    planned = tiers if tiers is not None else block_tiers(train, blocks_attr, len(numels), numels)
    offloaded = [i for i, t in enumerate(planned) if t != GPU]
    why_not = PARTITIONED_FROM_MASTERS if partitioned else masterless_reason(block_list, blocks_attr,
                                                                           offloaded)
    return weights_from_masters(train.params.weights_from_masters, train.precision,
                                sum(numels[i] for i in offloaded), cpu_capacity, why_not)


PARTITIONED_FROM_MASTERS = ("partitioned (multi-rank) jobs keep each block's weights as shards "
                            "gathered in the training dtype, which this does not make from masters")


def masterless_reason(block_list: torch.nn.Module, blocks_attr: str, offloaded: list[int]) -> str:
    """Why the offloaded blocks' weights cannot be made from masters ('' where they can):
    every tensor of such a block needs a master to be made from."""
    for i in offloaded:
        others = masterless_tensors(block_list[i])
        if others:
            return (f"block {blocks_attr}.{i} holds {others[0]!r}, which has no fp32 master "
                    f"(a buffer or a frozen parameter) to make it from")
    return ""


def _store_from_masters(train: TrainConfig, store_from_masters: bool, why_not: str) -> bool:
    """The store's setting, checked against the config: 'on' needs a store made so, and a
    store made so needs blocks whose every tensor has a master."""
    setting = train.params.weights_from_masters
    if setting == "on" and train.precision != "fp32":
        weights_from_masters("on", train.precision, 0, 0, why_not)  # refuses with `why_not`
        if not store_from_masters:
            raise ConfigError("train.params.weights_from_masters 'on': the store keeps the "
                              "weights; make the job with tierstack.worker.job.open_job, or "
                              "the store with from_masters=True")
    if store_from_masters and why_not:
        raise ConfigError(f"the store makes weights from masters (from_masters=True), but "
                          f"{why_not}; make it with from_masters=False")
    return store_from_masters


def pending_moment_bytes(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> int:
    """Device bytes AdamW's two moments will add for `params` that have none yet (made
    lazily by the optimizer's first step, in the dtype of the parameters it updates)."""
    return sum(2 * p.numel() * p.element_size() for p in params if p not in optimizer.state)


def check_capacity(model: torch.nn.Module, precision: str, hbm: int, node: NodeInfo,
                   largest_block: int = 0, from_masters: bool = False) -> None:
    """Refuse, before anything is stored, a model whose training state cannot fit the HBM
    budget and the tier manager's pools together; name the smallest budgets that would.
    `largest_block`: the parameters of the largest block. A streamed block's step writes
    its new versions (parameters, masters, moments) before it frees the old, and the
    daemon pipelines two blocks' steps, so the pools need room for two blocks' new
    versions besides the state (the H200's 19.49e9-parameter GPT, its state 97% of the
    budgets, ran out of NVMe room in its second step with one block's room counted). A
    model whose whole state fits the HBM budget streams nothing and needs no such room.
    `from_masters`: the weights are made from the masters, none stored (2 bytes per
    parameter fewer in bf16 and fp16)."""
    state = training_state_bytes(model, precision, from_masters)
    working = 0 if state <= hbm else \
        2 * largest_block * _updated_bytes_per_parameter(precision, from_masters)
    need = state + working
    have = hbm + node.cpu_capacity + node.nvme_capacity
    if need > have:
        gib = 1 << 30
        short = need - have
        raise ConfigError(
            f"the model's training state needs {need / gib:.1f} GiB (with {working / gib:.1f} GiB "
            f"of room for a streamed block's step) but the budgets hold "
            f"{have / gib:.1f} GiB (HBM {hbm / gib:.1f}, the tier manager's CPU pool "
            f"{node.cpu_capacity / gib:.1f} and NVMe pool {node.nvme_capacity / gib:.1f}); raise "
            f"budgets.nvme (tier_manager.nvme_pool.size) to at least "
            f"{(node.nvme_capacity + short) / gib:.1f} GiB, or budgets.host by "
            f"{short / gib:.1f} GiB")


def job_budgets(config: BudgetsConfig, store: BlockStore) -> Budgets:
    """A job's budgets: the config's where stated, else the machine's (measured now); the
    NVMe budget's ceiling is what the store's tier manager holds on its drives (it knows
    them). The one place a worker turns budget settings into bytes."""
    limits = dataclasses.replace(measure(None, str(store.device)),
                                 nvme=store.tiers.node().nvme_capacity)
    return config.resolve(limits)


def materialize(module: torch.nn.Module, device) -> None:
    """Give a module built on the meta device real tensors on `device`, initialised by each
    submodule's own `reset_parameters` (a model too large for host memory is built with
    `torch.device("meta")` and materialised one block at a time). Submodules that already
    have real tensors are left as they are, so a model can be materialised in parts."""
    with torch.no_grad():
        for sub in module.modules():
            own = list(sub.parameters(recurse=False)) + list(sub.buffers(recurse=False))
            if any(t.is_meta for t in own):
                sub.to_empty(device=device, recurse=False)
                if hasattr(sub, "reset_parameters"):
                    sub.reset_parameters()


class OffloadEngine:
    """Trains `model` with `model.<blocks_attr>` offloaded through `store`."""

    def __init__(self, model: torch.nn.Module, store: BlockStore, train: TrainConfig,
                 budgets: Budgets | None = None, *, blocks_attr: str = "blocks",
                 initialize: Callable[[torch.nn.Module, torch.device], None] = materialize,
                 param_groups: list[dict] | None = None, tiers: list[str] | None = None) -> None:
        """An engine as `train` says (precision, optimizer, clipping, accumulation, where each
        block's state lives, the prefetch depth, activations, fp16's loss scaling), placing
        what fits on the device within `budgets`: the job's, made once per process
        (`job_budgets`); None: the machine's. An HBM budget of 0 places nothing there.
        `initialize(module, device)` creates the tensors of a module built on the meta
        device, one block at a time, then the rest of the model (default: `materialize`;
        a Hugging Face model brings its own init or its weights).
        `param_groups`: torch-style groups of the model's trainable parameters with their
        lr, weight_decay, betas and eps (default: one group, train.optimizer's); a
        trainable parameter in no group is frozen.
        `tiers`: each block's tier, instead of what `train` places (a placement by hand:
        tierstack.tiers.BLOCK_TIERS per block; benchmarks)."""
        train.validate("train")  # the loader's own checks (a TrainConfig made in code too)
        block_list = model.get_submodule(blocks_attr)
        count = len(block_list)
        numels = [sum(p.numel() for p in block.parameters()) for block in block_list]
        ModuleTiers(train.tier_overrides).check_matches(name for name, _ in model.named_modules())
        if budgets is None:
            budgets = job_budgets(BudgetsConfig(), store)
        node = store.tiers.node()
        planned = tiers if tiers is not None else block_tiers(train, blocks_attr, count, numels)
        offloaded = [i for i, t in enumerate(planned) if t != GPU]
        self.from_masters = _store_from_masters(
            train, store.from_masters, self._why_not_from_masters(block_list, blocks_attr, offloaded))
        if self.from_masters:
            log.info("train.params.weights_from_masters %r: the offloaded blocks' weights are "
                     "their fp32 masters rounded on the way to the device (12 bytes per "
                     "parameter in host memory, not 14)", train.params.weights_from_masters)
        check_capacity(model, train.precision, budgets.hbm, node, max(numels, default=0),
                       self.from_masters)
        self.model = model
        self.store = store
        self.train = train
        self.precision = train.precision
        self.budgets = budgets
        self.param_groups = param_groups_of(model, train.optimizer, param_groups)
        self._group_of = group_by_name(model, self.param_groups)
        self.loss_scaler = None
        if train.precision == "fp16":
            from tierstack.worker.engine.loss_scaler import DynamicLossScaler
            self.loss_scaler = DynamicLossScaler(train.fp16)
        self.last_step_applied = False  # whether the last step() updated the weights
        self.blocks_attr = blocks_attr
        self.gradient_clipping = train.gradient_clipping
        self.gradient_accumulation_steps = train.gradient_accumulation_steps
        self.activation_policy = train.activations.policy
        if tiers is None:
            self.tiers = block_tiers(train, blocks_attr, count, numels)
            self.state_tiers = state_tiers(train, blocks_attr, count, numels)
            resident_ok = may_be_resident(train, blocks_attr, count)
        else:
            if len(tiers) != count or any(t not in BLOCK_TIERS for t in tiers):
                raise ConfigError(f"tiers must name one of {BLOCK_TIERS} for each of the {count} "
                                  f"blocks, got {tiers}")
            self.tiers, self.state_tiers = list(tiers), list(tiers)
            resident_ok = [t == AUTO for t in tiers]
        positions = [i for i, t in enumerate(self.tiers) if t != GPU]
        self._resident_ok = [ok for ok, t in zip(resident_ok, self.tiers) if t != GPU]
        self._offload_blocks(block_list, positions, initialize)
        if self.from_masters and not train.device_budget and positions:
            # "Three layers' worth" of loads: each holds its staging masters too (a stated
            # train.device_budget is a bound that includes them, and stays as it is).
            loads = DEVICE_BUDGET_LAYERS * max(store.layer_nbytes(i) for i in range(len(positions)))
            if loads > store.figures().device_capacity:
                store.resize_device_budget(loads)
        self._keep_the_rest(model, initialize)
        self.placement: BlockPlacement | None = None
        # Where the loss may stop the model to take it a chunk at a time (None: no head).
        self._head = output_head(model)
        self.footprint: DeviceFootprint | None = None
        # The last step's gradient norm: a float, or a device scalar read only when asked
        # (no step waits for the device to say it); None before the first step.
        self._last_norm: float | torch.Tensor | None = None
        self._placement_pending = bool(budgets.hbm > 0 and positions)
        self.phases: PhaseClock | NoPhases = NO_PHASES  # time_phases() turns it on

    def _why_not_from_masters(self, block_list: torch.nn.Module, blocks_attr: str,
                              offloaded: list[int]) -> str:
        """Why this engine cannot make the offloaded blocks' weights from their masters
        ('' where it can). A partitioned engine says its own reason."""
        return masterless_reason(block_list, blocks_attr, offloaded)

    def _offload_blocks(self, block_list: torch.nn.Module, positions: list[int],
                        initialize: Callable[[torch.nn.Module, torch.device], None]) -> None:
        """Store the offloaded blocks with the tier manager, one materialised at a time."""
        store, train, dtype = self.store, self.train, PRECISIONS[self.precision]
        if train.params.buffer_size and train.params.tier() != GPU:
            _check_buffer_size(block_list, self.blocks_attr, positions, train.params.buffer_size)
        wrong = [i for i in positions if self.state_tiers[i] == GPU]
        if wrong:  # the tier manager runs an offloaded block's AdamW: its state is there
            raise ConfigError(f"offloaded blocks {wrong} cannot keep their optimizer state on "
                              f"the device; give them 'cpu', 'nvme' or 'auto'")
        for layer, position in enumerate(positions):
            store.place(layer, self.tiers[position], self.state_tiers[position])
        # Blocks whose masters are put off until the placement (see prepare).
        self.deferred_masters: set[int] = set()
        defer = self.budgets.hbm > 0 and bool(positions)

        def prepare(i: int, block: torch.nn.Module) -> None:
            initialize(block, store.device)  # initialised where it is fastest; stored at once
            if dtype == torch.float32:
                return
            trainable = [(n, p) for n, p in block.named_parameters() if p.requires_grad]
            if defer and not self.from_masters and all(p.dtype == dtype for _, p in trainable):
                # Weights already in the training dtype: their masters are those values
                # widened, made once the placement knows where the block lives (on the
                # device for a resident block) rather than held in host memory ahead of it.
                self.deferred_masters.add(i)
            else:  # fp32 masters come from the fp32 weights
                store.write_back(i, {f"{n}.master": p.detach().float() for n, p in trainable},
                                 kind="master")
            block.to(dtype)

        prefetch_depth = max(1, train.params.buffer_count - 1)
        self.blocks = OffloadedBlocks(block_list, store, prefetch_depth, positions, prepare,
                                      write_weights=lambda i, w: self.views.write_block_weights(i, w),
                                      prefix=f"{self.blocks_attr}.")
        self._apply_activation_policy()
        if train.activations.partition:
            self._partition_activations()

    def _keep_the_rest(self, model: torch.nn.Module,
                       initialize: Callable[[torch.nn.Module, torch.device], None]) -> None:
        """What is left in the model stays on the device (persistent), created there, with
        its fp32 masters and the device's AdamW; then the blocks' optimizer."""
        store, optimizer, dtype = self.store, self.train.optimizer, PRECISIONS[self.precision]
        initialize(model, store.device)
        persistent_fp32 = None
        if dtype != torch.float32:
            persistent_fp32 = [p.detach().float().clone() for p in model.parameters()
                               if p.requires_grad and not is_parked(p)]  # not the offloaded blocks'
            model.to(dtype)
        model.to(store.device)
        named_persistent = [(n, p) for n, p in model.named_parameters()
                            if p.requires_grad and not is_parked(p)]
        self.persistent = [p for _, p in named_persistent]
        persistent_names = [n for n, _ in named_persistent]
        # fp32 masters of the persistent parameters (the parameters themselves in fp32).
        self.persistent_masters = (self.persistent if persistent_fp32 is None else
                                   [m.to(store.device).requires_grad_() for m in persistent_fp32])
        self.views = ModelViews(self)
        self.views.own_persistent(self.persistent)
        hyper = dict(lr=optimizer.lr, betas=tuple(optimizer.betas), eps=optimizer.eps,
                     weight_decay=optimizer.weight_decay)
        self.persistent_optimizer = torch.optim.AdamW(
            self._device_groups(persistent_names, self.persistent_masters) or
            [{"params": [], "group": 0}], fused=True, **hyper)
        self.block_optimizer = self._make_block_optimizer(optimizer, masters=dtype != torch.float32)
        self._refresh_rates()
        if self.block_optimizer.asynchronous:
            self.block_optimizer.asynchronous = self._pool_fits_overlap(store)
        # Clipping, and fp16's overflow check, need the norm before anything is stepped:
        # then no block's step starts inside the backward.
        self.step_needs_every_gradient = self.gradient_clipping > 0 or dtype == torch.float16
        # Every step's norm, as DeepSpeed's get_global_grad_norm reports it: each block's
        # squared norm is taken as its gradients are stored (one reduction, no wait).
        self.blocks.track_grad_norms = True

    def _apply_activation_policy(self) -> None:
        """Give every offloaded block the configured activation policy (not "auto")."""
        policy, blocks = self.activation_policy, self.blocks
        for index in blocks.offloaded():
            blocks.keep_activations[index] = policy == "keep"
            blocks.input_tiers[index] = policy if policy in HOST_TIERS else None
        if policy == "keep" and blocks.blocks:
            # Every block's tensors stay from its forward to its backward, with the
            # prefetch window on top: the layer store must hold them all.
            layers = [self.store.layer_nbytes(i) for i in blocks.offloaded()]
            figures = self.store.figures()
            need = sum(layers) + figures.prefetch_depth * max(layers)
            if need > figures.device_capacity:
                log.info("train.activations.policy 'keep': the device budget grows from %d to "
                         "%d bytes to hold every offloaded block from forward to backward",
                         figures.device_capacity, need)
                self.store.resize_device_budget(need)

    def _partition_activations(self) -> None:
        """train.activations.partition on one rank: no other tier manager to spread over."""
        log.info("train.activations.partition: one rank, one tier manager: each block input "
                 "stays whole with it")

    def _pool_fits_overlap(self, store: BlockStore) -> bool:
        """Whether the blocks' updates may run behind the next forward: where the CPU pool
        holds, twice over, what that overlap holds at once (two blocks' whole state being
        updated, the forward's window of layers). A smaller pool (a few blocks' worth)
        would be full of held tensors at times: there the updates finish first."""
        if not self.blocks.blocks:
            return False
        layers = [store.layout(i).nbytes for i in range(len(self.blocks.blocks))]
        state = max(4 * n for n in layers)  # parameters, gradients, two moments (and masters)
        need = 2 * state + (store.figures().prefetch_depth + 1) * max(layers)
        return store.tiers.node().cpu_capacity >= 2 * need

    def _make_block_optimizer(self, optimizer: OptimizerConfig, masters: bool):
        """The offloaded blocks' optimizer (partitioned training brings its own)."""
        prefixes = [f"{self.blocks_attr}.{p}." for p in self.blocks.positions]
        return TieredAdamW(self.blocks, optimizer, masters=masters,
                           group_of=lambda i, name: self._group_of[prefixes[i] + name])

    # ---- param groups: each parameter's hyperparameters, read at every step ----------------

    def _device_groups(self, names: list[str], masters: list[torch.Tensor]) -> list[dict]:
        """torch param groups of the device's AdamW for the parameters `names` (their fp32
        `masters` stepped), one per param group they are in; each remembers its group."""
        by_group: dict[int, list[torch.Tensor]] = {}
        for name, m in zip(names, masters):
            by_group.setdefault(self._group_of[name], []).append(m)
        return [{"params": ms, "group": g} for g, ms in sorted(by_group.items())]

    def _refresh_rates(self) -> None:
        """Carry the param groups' current hyperparameters (a schedule changes lr between
        steps) to the device's AdamW and the blocks' optimizer."""
        first = self.param_groups[0]
        for g, group in enumerate(self.param_groups):
            if tuple(group["betas"]) != tuple(first["betas"]) or group["eps"] != first["eps"]:
                raise ConfigError(
                    f"param group {g} has betas {tuple(group['betas'])} and eps {group['eps']}, "
                    f"group 0 {tuple(first['betas'])} and {first['eps']}: the tier manager steps "
                    f"every group of a block with one betas and eps; give the groups the same "
                    f"betas and eps (lr and weight_decay may differ)")
        for torch_group in self.persistent_optimizer.param_groups:
            group = self.param_groups[torch_group["group"]]
            for name in ("lr", "weight_decay", "eps"):
                torch_group[name] = group[name]
            torch_group["betas"] = tuple(group["betas"])
        self.block_optimizer.set_rates([(g["lr"], g["weight_decay"]) for g in self.param_groups],
                                       tuple(first["betas"]), first["eps"])

    def zero_grad(self) -> None:
        """Clear gradients: the next backward starts a new accumulation window."""
        self.blocks.release_kept()
        for p in self.persistent:
            p.grad = None
        for m in self.persistent_masters:
            m.grad = None
        self.blocks.new_gradients()

    @property
    def last_gradient_norm(self) -> float | None:
        """The last optimizer step's gradient norm (before clipping, after unscaling), as
        torch.nn.utils.clip_grad_norm_ computes it; None before the first step."""
        if isinstance(self._last_norm, torch.Tensor):
            self._last_norm = self._last_norm.item()
        return self._last_norm

    def _gradient_norm(self) -> float:
        """The global L2 norm of the window's gradients (inf or NaN where they overflowed),
        as torch.nn.utils.clip_grad_norm_ computes it."""
        return float(self._gradient_norm_tensor())

    def _gradient_norm_later(self, scale: float) -> float | torch.Tensor:
        """The norm times `scale` for a step that does not need it: a device scalar, read
        when someone asks (a partitioned engine's is a collective: every rank, now)."""
        return self._gradient_norm_tensor() * scale

    def _gradient_norm_tensor(self) -> torch.Tensor:
        blocks = self.blocks  # a block no gradient reached in this window has none
        squares = [n for i, n in enumerate(blocks.grad_sq_norms) if n is not None and blocks.has_gradients(i)]
        squares += [squared_norm(p.grad) for p in self.persistent if p.grad is not None]
        if not squares:
            return torch.zeros((), device=self.store.device)
        return torch.stack([s.to(self.store.device) for s in squares]).sum().sqrt()

    def _store_deferred_masters(self) -> None:
        """Store the fp32 masters put off at registration for the blocks still offloaded
        (their stored parameters widened): before anything reads or steps them."""
        def store(index: int) -> None:
            params = self.store.read_layer(index)
            self.store.write_back(index, {f"{n}.master": params[n].float()
                                          for n, _, _ in self.blocks.trainable(index)}, kind="master")

        indices = sorted(self.deferred_masters)
        if len(indices) > 1 and self.store.writes_from_any_thread:
            # A 1.3B LLaMA's 5.4 GB of masters took ~4.5 s of its first step one block at a
            # time (read, widen, allocate, pack: each mostly outside the GIL). A few blocks
            # at once; each holds one block's widened copy, so the transient stays small.
            with ThreadPoolExecutor(max_workers=MASTER_WRITERS,
                                    thread_name_prefix="tierstack-masters") as pool:
                list(pool.map(store, indices))  # the first failure is the step's
        else:
            for index in indices:
                store(index)
        self.deferred_masters.clear()

    def step(self, loss_scale: float = 1.0) -> bool:
        """The optimizer step after a backward: persistent parameters, then every block,
        at the param groups' current hyperparameters. `loss_scale`: what the loss was
        multiplied by (fp16); the gradients are divided by it, and a step whose gradients
        overflowed (inf or NaN anywhere) is skipped: nothing is updated, the gradients are
        dropped, and False is returned."""
        self._store_deferred_masters()
        self._refresh_rates()
        self.last_step_applied = False
        scale = 1.0 / loss_scale
        if not self.step_needs_every_gradient:
            self._last_norm = self._gradient_norm_later(scale)
        else:
            norm = self._gradient_norm() * scale
            self._last_norm = norm
            if not math.isfinite(norm):
                self.block_optimizer.abandon_started()
                self.zero_grad()
                return False
            if self.gradient_clipping > 0:
                scale *= min(1.0, self.gradient_clipping / (norm + 1e-6))
        if scale != 1.0:
            for p in self.persistent:
                if p.grad is not None:
                    p.grad.mul_(scale)
        self._step_persistent()
        self.block_optimizer.step(scale)
        self.last_step_applied = True
        return True

    def backward(self, loss: torch.Tensor, boundary: bool = True) -> None:
        """Backward of `loss` (already scaled as the caller wants), its gradients added to
        the window's. At an accumulation `boundary`, each block's AdamW step may start in
        the tier manager as soon as its gradients are stored, overlapping the rest of the
        backward, unless the step needs every gradient first (clipping; fp16's overflow
        check)."""
        if boundary and not self.step_needs_every_gradient:
            self._refresh_rates()
            self.blocks.on_gradients = self.block_optimizer.start_block
        try:
            try:
                loss.backward()
            finally:  # the step reads every gradient; a failed write fails the backward
                self.blocks.wait_for_gradients()
        except BaseException:
            # Blocks already stepped keep their update: resume from a checkpoint.
            self.block_optimizer.abandon_started()
            raise
        finally:
            self.blocks.on_gradients = None

    def _step_persistent(self) -> None:
        """AdamW for the parameters on the device. With fp32 masters, one param group at a
        time (the persistent parameters, then each resident block): a group's gradients
        are widened to fp32 just before its step and dropped after, so the device holds
        one group's fp32 gradients at a time, not every resident block's (the placement
        counts a resident block at 16 bytes per parameter, with no room for a 4-byte copy
        of every gradient). AdamW skips parameters without a gradient, so each call
        steps exactly that group."""
        optimizer = self.persistent_optimizer
        if self.persistent_masters is self.persistent:
            optimizer.step()
            return
        param_of = {id(m): p for p, m in zip(self.persistent, self.persistent_masters)}
        for group in optimizer.param_groups:
            pairs = [(param_of[id(m)], m) for m in group["params"]]
            for p, m in pairs:
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
            optimizer.step()
            with torch.no_grad():
                for p, m in pairs:
                    p.copy_(m)
                    m.grad = None

    def micro_batches(self, inputs: torch.Tensor, targets: torch.Tensor
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The batch's rows in gradient_accumulation_steps equal micro-batches."""
        steps, rows = self.gradient_accumulation_steps, inputs.shape[0]
        if rows % steps or targets.shape[0] != rows:
            raise InvalidArgumentError(
                f"a batch of {rows} rows (targets: {targets.shape[0]}) does not split into "
                f"train.gradient_accumulation_steps = {steps} equal micro-batches; give a "
                f"multiple of {steps} rows (micro_batch_size x gradient_accumulation_steps)")
        return list(zip(inputs.chunk(steps), targets.chunk(steps)))

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward and backward over each micro-batch of the batch, then one optimizer
        step; returns the batch's mean loss (the mean of the micro-batches' means)."""
        inputs, targets = inputs.to(self.store.device), targets.to(self.store.device)
        micro = self.micro_batches(inputs, targets)
        if self._placement_pending:
            self.place(*micro[0])
        self.zero_grad()
        losses = []
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        phases = self.phases
        for i, (x, y) in enumerate(micro):
            with phases.device("forward"):
                loss = self._loss(x, y)
            losses.append(loss.detach())
            # A block's step may start inside the backward only once its gradients are
            # complete: the last micro-batch.
            with phases.device("backward"):
                self.backward(loss * (scale / len(micro)), boundary=i == len(micro) - 1)
        with phases.device("optimizer"):
            applied = self.step(scale)
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=not applied)
        return torch.stack(losses).mean().item()

    def time_phases(self) -> PhaseClock:
        """From now on, time each step's forward, backward and optimizer call (on CUDA as
        the device ran them: worker/store/step_phases.py); the clock's totals() are running sums."""
        self.phases = PhaseClock(self.store.device)
        return self.phases

    # ---- placement: budgets in, what lives on the device out -------------------------------

    def place(self, inputs: torch.Tensor, targets: torch.Tensor) -> BlockPlacement:
        """Measure one forward and backward on this micro-batch (every block streamed and,
        under policy "auto", recomputed: the safe placement; under an explicit policy, in
        that policy), then place what fits the HBM budget on the device
        (worker/engine/placement.py). Runs once, before the first step; the probe's gradients are
        thrown away."""
        return self.place_with(lambda: self._loss(inputs, targets))

    @property
    def placement_pending(self) -> bool:
        """Whether the first training forward must measure and place first (`place_with`)."""
        return self._placement_pending

    def place_with(self, loss: Callable[[], torch.Tensor]) -> BlockPlacement:
        """`place` for any training forward: `loss()` runs the model's forward on a real
        micro-batch and returns a scalar to run the backward from (the probe's). The RNG
        is put back after it, so the step after sees the random numbers (dropout) it would
        have seen without the probe."""
        self._placement_pending = False
        self.block_optimizer.wait_all()  # the stored state is current before it is read
        policy = self.activation_policy
        recorder = self.store.record_uses(None)  # not part of a trace
        try:
            devices = [self.store.device] if self.store.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                self.footprint = self._probe(loss)
        except torch.cuda.OutOfMemoryError as e:
            if policy == AUTO:
                raise
            raise ConfigError(
                f"train.activations.policy {policy!r}: the placement's probe step, which keeps "
                f"on the device what the policy keeps, ran out of device memory (budgets.hbm "
                f"{self.budgets.hbm / MiB:,.0f} MiB); set the policy to 'auto' (keeps what fits, "
                f"recomputes or offloads the rest) or lower the micro-batch or sequence length") from e
        finally:
            self.store.record_uses(recorder)
        offloaded = self.blocks.offloaded()
        if policy != AUTO:  # the probe ran in it: no inputs sent out, nothing recomputed for it
            check_policy_fits(self.footprint, self.budgets.hbm, policy)
        placement = place_blocks(self.footprint, self.budgets.hbm, self._resident_ok,
                                 window_layers=self.store.figures().prefetch_depth + 1)
        for index in placement.resident:
            keep = index in placement.keep_activations if policy == AUTO else policy == "keep"
            self._make_resident(index, recompute=not keep)
        if policy == AUTO:
            for index in placement.keep_activations:
                self.blocks.keep_activations[index] = True
            for index in placement.offload_inputs:  # the CPU pool keeps what fits, NVMe the rest
                self.blocks.input_tiers[index] = AUTO
        if len(placement.resident) < len(offloaded):
            self.store.resize_device_budget(max(placement.layer_budget, self.store.figures().device_used, 1))
        if policy != AUTO:  # the configured policy for the blocks left offloaded
            self._apply_activation_policy()
            placement = under_policy(placement, self.footprint, policy)
        self._store_deferred_masters()  # of the blocks left offloaded
        left = self.blocks.offloaded()  # a step loads every block forward, then backward
        self.store.set_access_order(left + left[::-1])
        self.placement = placement
        log.info("placement within %s: %s", self.budgets.describe(),
                 placement.describe(len(self.blocks.blocks)))
        return placement

    def _probe(self, run_loss: Callable[[], torch.Tensor]) -> DeviceFootprint:
        cuda = self.store.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.store.device)
            torch.cuda.reset_peak_memory_stats(self.store.device)
        self.zero_grad()
        # The probe keeps the block inputs on the device if they all fit in half the HBM
        # budget: the other half is for what the forward cannot see yet (the loss, a
        # block's recompute and its gradients). Else they all wait with the tier manager
        # (the safe placement) and count in the peak as if kept: the footprint is the
        # same either way (a bound when the peak comes after the backward has dropped
        # some inputs).
        self.blocks.start_probe(self.budgets.hbm // 2)
        try:
            with SavedBytes() as outside:
                loss = run_loss()
            loss.backward()
        finally:
            self.blocks.measure_activations = False
        self.zero_grad()
        stashed = self.blocks.probe_stashed_bytes
        store = self.store
        layers = tuple(store.layout(i).nbytes for i in range(len(self.blocks.blocks)))
        # A load holds its staging buffer too (weights made from masters): the window's bytes.
        loads = tuple(store.layer_nbytes(i) for i in range(len(self.blocks.blocks)))
        activations = tuple(self.blocks.activation_bytes)
        inputs = tuple(self.blocks.input_bytes)
        states, numels = [], []
        for i in range(len(self.blocks.blocks)):
            trainable = self.blocks.trainable(i)
            numel = sum(math.prod(shape) for _, shape, _ in trainable)
            grads = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in trainable)
            masters = 4 * numel if self.block_optimizer.masters else 0
            states.append(layers[i] + grads + masters + 2 * 4 * numel)
            numels.append(numel)
        # What the device's optimizer step adds to every later step, which the probe (no
        # step) did not see: the persistent parameters' AdamW moments, made by their first
        # step, and with fp32 masters one param group's gradients widened to fp32 at a
        # time (_step_persistent): the persistent parameters' or a resident block's.
        extra = pending_moment_bytes(self.persistent_optimizer, self.persistent_masters)
        if self.persistent_masters is not self.persistent:
            extra += 4 * max([sum(p.numel() for p in self.persistent)] + numels)
        if cuda:
            torch.cuda.synchronize(store.device)
            peak = torch.cuda.max_memory_allocated(store.device) + extra + stashed
        else:  # no allocator to ask: what the step holds at its fullest, added up
            persistent = sum(p.numel() * (2 * p.element_size() + (0 if m is p else 4))
                             for p, m in zip(self.persistent, self.persistent_masters))
            peak = (persistent + extra + outside.bytes + stashed
                    + (store.figures().prefetch_depth + 1) * max(loads) + max(activations, default=0))
        return DeviceFootprint(int(peak), tuple(states), loads, activations, inputs)

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the model's logits; with large logits, a chunk of tokens at
        a time from the head's input (worker/engine/chunked_loss.py), never the whole logits."""
        return language_model_loss(self.model, self._head, inputs, targets)

    def _make_resident(self, index: int, recompute: bool = False) -> None:
        """Bring offloaded block `index` to the device for good: its tensors, fp32 masters
        and AdamW moments come from the tier manager once, it joins the persistent
        parameters (the device AdamW steps it from now on), and its keys are deleted."""
        store, device = self.store, self.store.device
        tensors = {name: t.to(device) for name, t in store.read_layer(index).items()}
        block = self.blocks.make_resident(index, tensors, recompute)
        named = [(n, p) for n, p in block.named_parameters() if p.requires_grad]
        masters = [p for _, p in named]
        if index in self.deferred_masters:  # never stored: the weights widened, here
            self.deferred_masters.discard(index)
            masters = [p.detach().float().requires_grad_() for _, p in named]
        elif self.block_optimizer.masters:
            stored = store.read_layer(index, "master")
            masters = [stored[f"{n}.master"].to(device).requires_grad_() for n, _ in named]
        steps = self.block_optimizer.steps
        self.persistent.extend(p for _, p in named)
        self.views.own_persistent([p for _, p in named])
        if self.persistent_masters is not self.persistent:
            self.persistent_masters.extend(masters)
        prefix = f"{self.blocks_attr}.{self.blocks.positions[index]}."
        for group in self._device_groups([prefix + n for n, _ in named], masters):
            self.persistent_optimizer.add_param_group(group)
        self._refresh_rates()
        if steps:  # the moments exist from the first step on
            moments = {kind: store.read_layer(index, kind) for kind in MOMENTS}
            for (name, _), master in zip(named, masters):
                self.persistent_optimizer.state[master] = {
                    "step": torch.tensor(float(steps), dtype=torch.float32, device=device),
                    **{kind: moments[kind][f"{name}.{kind}"].to(device) for kind in MOMENTS}}
        store.forget_layer(index, kinds=("grad", "master") + MOMENTS)

    def wait_for_optimizer(self) -> None:
        """Wait for the blocks' updates of the last step (they run behind the next
        forward): before reading the stored state (checkpoints, export)."""
        self.block_optimizer.wait_all()
        self._store_deferred_masters()

    def close(self) -> None:
        try:
            self.block_optimizer.close()
        finally:
            self.blocks.stash.close()
            if self.blocks.gradient_writes is not None:
                self.blocks.gradient_writes.close()


def _check_buffer_size(block_list: torch.nn.Module, blocks_attr: str, positions: list[int],
                       buffer_size: int) -> None:
    """Refuse an offloaded block holding a tensor of more than `buffer_size` elements
    (train.params.buffer_size; meta tensors count too: nothing is created yet)."""
    for position in positions:
        for name, tensor in block_list[position].state_dict(keep_vars=True).items():
            if tensor.numel() > buffer_size:
                raise ConfigError(
                    f"block {blocks_attr}.{position}: tensor {name!r} has {tensor.numel():,} "
                    f"elements, more than train.params.buffer_size ({buffer_size:,}); raise it "
                    f"to at least {tensor.numel()}, or keep the block on the device with "
                    f"train.tier_overrides")

