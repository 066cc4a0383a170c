"""A job's composition root: every door builds its job here, and nowhere else.

The doors — `tierstack.initialize` (and the Trainer through it), `tierstack train`, the
partitioned job's ranks (plain, torchrun or Ray actors) and `tierstack launch` — are thin
adapters: each turns what its user wrote into a `JobSpec` and calls `open_job` (launch,
which runs a script whose own `initialize` builds the job, and the Ray job, whose ranks
do, call `open_services`). `open_job` decides, in this order:

1. the node's services (worker/node/services.py): the named or the node's tier manager,
   or one started for the job with its NVMe directory under the one default root, and
   the scheduler whose plans the job follows (the named, the node's, or one started
   beside an embedded tier manager);
2. the budgets, measured and resolved once (`job_budgets`), and the device budget
   (train.device_budget, else DEVICE_BUDGET_LAYERS of the largest block);
3. whether the blocks' weights are made from their fp32 masters (a store setting);
4. the store (`LayerStore`, or `ShardedLayerStore` for a partitioned job), its settings
   as constructor arguments;
5. the engine (`OffloadEngine`, or `ShardedEngine`), which reaches the store through its
   named calls;
6. the plan follower and keeper: the job's trace goes to the scheduler after settled
   steps, the plans come back, and a step off the plan's band traces again.

The job's parts close in the reverse order, together: `Job.close`, or, for a job whose
owner never closes it (no DeepSpeed script calls close), when its owner is collected or
the interpreter exits (`close_with`) — a script that ends without close, or dies of an
exception, leaves no tier manager, NVMe directory or run record behind.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from tierstack.budgets import Budgets
from tierstack.config import DEVICE_BUDGET_LAYERS, TierstackConfig
from tierstack.config_keys import UserKeys
from tierstack.errors import TierstackError
from tierstack.services.scheduler.model import Plan
from tierstack.services.tier_manager.client import TierManagerClient
from tierstack.worker.engine.offload_engine import (OffloadEngine, decide_weights_from_masters,
                                                    job_budgets, materialize)
from tierstack.worker.engine.sharded_engine import ShardedEngine
from tierstack.worker.node.services import NodeServices, SchedulerUse, open_node_services
from tierstack.worker.plans.follower import PlanFollower
from tierstack.worker.plans.keeper import PlanKeeper
from tierstack.worker.store.block_store import BlockStore
from tierstack.worker.store.layer_store import LayerStore
from tierstack.worker.store.layout import LayerLayout
from tierstack.worker.store.sharded_store import ShardedLayerStore

log = logging.getLogger(__name__)

__all__ = ["Job", "JobSpec", "SchedulerUse", "open_job", "open_services"]


@dataclass
class JobSpec:
    """What a door asks of a job: the model, its config, and the door's own flags."""

    name: str
    """The job's name on its node (its keys, its NVMe directory)."""
    config: TierstackConfig
    model: torch.nn.Module
    blocks_attr: str
    """The dotted name of the model's ModuleList of blocks to offload."""
    device: torch.device
    initialize: Callable[[torch.nn.Module, torch.device], None] = materialize
    """Creates the tensors of a module built on the meta device (one block at a time)."""
    param_groups: list[dict] | None = None
    partitioned: bool = False
    """Each rank keeps 1/N of every block (the process group is joined already)."""
    tier_manager: str = ""
    """A tier manager the door was given ('' to find or start one)."""
    tier_manager_setting: str = "tier_manager.listen"
    """How the user named `tier_manager` (for the error when it does not answer)."""
    scheduler: SchedulerUse = SchedulerUse.AUTO
    nvme_paths: list[str] | None = None
    """A door's flag over tier_manager.nvme_pool.paths (for a tier manager started here)."""
    nvme_setting: str = "--nvme-path"
    cpu_pool_size: int | str | None = None
    """A door's flag over tier_manager.cpu_pool.size (for a tier manager started here)."""
    device_budget: int = 0
    """A door's flag over train.device_budget (bytes; 0: the config's)."""
    device_budget_layers: int = DEVICE_BUDGET_LAYERS
    """Without a device budget stated: this many of the largest block's loads."""
    total_steps: int | None = None
    """Optimizer steps the run will take, where the door knows (plans, ETA)."""
    first_step: int = 0
    """Steps done before this run (a resumed run)."""
    keep: bool = False
    """Keep the job's state with its tier manager after the job ends."""
    keys: UserKeys = field(default_factory=UserKeys)
    """The keys the user wrote for the config's (a DeepSpeed JSON's): every error the job
    raises while it is built names the user's key (config.load_config_with_keys)."""


@dataclass
class Job:
    """A job's parts, made by `open_job`, closed together."""

    spec: JobSpec
    services: NodeServices
    budgets: Budgets
    store: BlockStore
    engine: OffloadEngine
    follower: PlanFollower | None = None
    keeper: PlanKeeper | None = None
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, repr=False)
    _closer: Any = field(default=None, repr=False)
    _plans_failed: bool = field(default=False, repr=False)

    @property
    def plan(self) -> Plan | None:
        """The scheduler's plan the job follows now (None: none yet, or no scheduler)."""
        return self.follower.plan if self.follower is not None else None

    def step_done(self, step: int, seconds: float | None, loss: float | None = None,
                  tokens: int = 0, learning_rate: float | None = None) -> Plan | None:
        """Optimizer step `step` (counted from 1 over the run, resumed steps included) ended
        after `seconds` (None: not known, the first step of a loop): the plan keeper
        decides whether to record, report or trace again, and the node's dashboard hears of
        the step, its loss as the user's code computed it, the tokens this worker trained in
        it and its learning rate. Returns a plan a trace reported now produced. A scheduler
        that cannot plan the job costs the job its plans (said once), never the training."""
        plan = None
        if seconds is not None and self.keeper is not None and not self._plans_failed:
            try:
                plan = self.keeper.step_done(seconds)
            except TierstackError as e:
                self._plans_failed = True
                log.warning("job %s: the scheduler at %s cannot plan it (%s); the job keeps its "
                            "configured prefetch depths", self.spec.name, self.services.scheduler, e)
        reports = self.store.reports
        if reports is not None:
            if seconds is not None:
                current = self.plan
                reports.step(seconds, current.predicted_step_seconds if current is not None else 0.0)
            reports.training(step, loss, tokens, learning_rate, self.spec.total_steps)
        return plan

    def starting_at(self, step: int) -> None:
        """A resumed run starts after `step` (before its first step here): the plan keeper
        warms up and traces within the steps left."""
        self.spec.first_step = step
        if self.follower is not None:
            warmup, iterations = _trace_steps(self.spec)
            self.keeper = PlanKeeper(self.follower, self.keeper.optimizer_seconds, warmup=warmup,
                                     iterations=iterations)

    def close_with(self, owner: object) -> Callable[[], None]:
        """Close the job when `owner` is collected or the interpreter exits, unless closed
        before; returns the call that closes it now (at most once)."""
        self._closer = weakref.finalize(owner, self._stack.close)
        return self._closer

    def close(self) -> None:
        """Stop following plans, close the engine and the store, stop what was started for
        the job and remove its directories (the reverse of their making)."""
        if self._closer is not None:
            self._closer()
        else:
            self._stack.close()


def open_services(stack: contextlib.ExitStack, config: TierstackConfig, name: str,
                  keys: UserKeys = UserKeys(), **options) -> NodeServices:
    """The node's services for job `name`, as open_job decides them (worker/node/services.py),
    for a door whose job is built elsewhere (`tierstack launch`: the script's initialize;
    the Ray job: its ranks). What is started stops when `stack` closes; an error names the
    settings as the user wrote them (`keys`)."""
    try:
        return open_node_services(stack, config, name, keys=keys, **options)
    except TierstackError as e:
        raise keys.rename(e) from None


def open_job(spec: JobSpec) -> Job:
    """The job `spec` asks for, its parts made in order (module docstring). One error, in the
    user's keys, where it cannot be built."""
    stack = contextlib.ExitStack()
    try:
        return _open(spec, stack)
    except TierstackError as e:
        stack.close()
        raise spec.keys.rename(e) from None
    except BaseException:
        stack.close()
        raise


def _open(spec: JobSpec, stack: contextlib.ExitStack) -> Job:
    config, train = spec.config, spec.config.train
    # Ranks of a partitioned job on one machine each have their own directory.
    directory = f"{spec.name}.rank{dist.get_rank()}" if spec.partitioned else spec.name
    services = open_node_services(
        stack, config, directory, tier_manager=spec.tier_manager,
        tier_manager_setting=spec.tier_manager_setting, scheduler=spec.scheduler,
        nvme_paths=spec.nvme_paths, nvme_setting=spec.nvme_setting,
        cpu_pool_size=spec.cpu_pool_size, keys=spec.keys)
    blocks = spec.model.get_submodule(spec.blocks_attr)
    largest = max((_layout_bytes(b) for b in blocks), default=1)
    device_budget = spec.device_budget or train.device_budget or spec.device_budget_layers * largest
    node = _node(services.tier_manager)
    from_masters = decide_weights_from_masters(spec.model, spec.blocks_attr, train,
                                               node.cpu_capacity, partitioned=spec.partitioned)
    if spec.partitioned:
        store = ShardedLayerStore(spec.name, device=spec.device, device_budget=device_budget,
                                  address=services.tier_manager, durable=False)
    else:
        store = LayerStore(spec.name, device=spec.device, device_budget=device_budget,
                           address=services.tier_manager, durable=False, keep=spec.keep,
                           from_masters=from_masters)
    stack.callback(store.close)
    budgets = job_budgets(config.budgets, store)
    engine_class = ShardedEngine if spec.partitioned else OffloadEngine
    engine = engine_class(spec.model, store, train, budgets, blocks_attr=spec.blocks_attr,
                          initialize=spec.initialize, param_groups=spec.param_groups)
    stack.callback(engine.close)
    job = Job(spec, services, budgets, store, engine, _stack=stack)
    if services.scheduler and _follows_plans(spec, store):
        job.follower = PlanFollower(store, services.scheduler, node_id=services.node_id)
        stack.callback(job.follower.close)
        stack.callback(_summarise_plans, job)
        warmup, iterations = _trace_steps(spec)
        job.keeper = PlanKeeper(job.follower, lambda: engine.block_optimizer.block_seconds,
                                warmup=warmup, iterations=iterations)
    log.info("job %s on %s: %s; device budget %.1f MiB, budgets %s", spec.name, spec.device,
             services.describe(), device_budget / (1 << 20), budgets.describe())
    return job


def _layout_bytes(block: torch.nn.Module) -> int:
    """Bytes of a block's stored layout, measured from its tensors' shapes and dtypes: meta
    tensors and zero.Init's parked parameters count, nothing needs to exist."""
    shapes = {name: torch.empty(t.shape, dtype=t.dtype, device="meta")
              for name, t in block.state_dict(keep_vars=True).items()}
    return LayerLayout.of(shapes).nbytes


def _node(address: str):
    client = TierManagerClient(address)
    try:
        return client.node()
    finally:
        client.close()


def _follows_plans(spec: JobSpec, store: BlockStore) -> bool:
    """Rank 0 of a partitioned job talks to the scheduler; every rank takes its plans at a
    step boundary (ShardedLayerStore.agree_on_plan). One rank follows its own."""
    return not spec.partitioned or store.writes_checkpoint


def _trace_steps(spec: JobSpec) -> tuple[int, int]:
    """(warm-up steps, steps traced) for the plan keeper: the first step probes the
    placement and creates the optimizer state; a short run traces fewer steps, so that a
    step still runs under its plan."""
    if spec.total_steps is None:
        return 1, 3
    remaining = spec.total_steps - spec.first_step
    warmup = max(0, min(1, remaining - 1))
    return warmup, max(1, min(3, remaining - warmup - 1))


def _summarise_plans(job: Job) -> None:
    """One line at the end: each plan the job ran under, predicted against measured."""
    if job.keeper is None or not job.keeper.plans:
        return
    log.info("job %s followed %s", job.spec.name, "; ".join(
        f"plan v{r.version} ({r.reason}): predicted {r.predicted_seconds:.3f} s, measured "
        f"{r.measured_seconds:.3f} s over {len(r.steps)} steps ({r.ratio:.2f}x)"
        for r in job.keeper.plans))
