"""`tierstack train --ranks N` / `--address`: partitioned training on Ray actors.

Without `--address`, Ray starts embedded on this machine (`ray.init()` with a small
object store: the actors exchange nothing through it but their results) and one tier
manager serves every rank, as the one daemon of this one node: the node's, or one started
for the job with a scheduler beside it, whose plans rank 0 follows (worker/job.py). With
`--address` (`auto`, or `host:port` of the head), the job joins that Ray cluster and
each rank uses its own node's tier manager, started by deploy/cluster.yaml.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import uuid

from rich.console import Console
from rich.table import Table

from tierstack.config import MiB, TierstackConfig, TrainConfig, parse_size
from tierstack.errors import ConfigError
from tierstack.extras import require
from tierstack.tiers import AUTO, GPU
from tierstack.worker.job import SchedulerUse, open_services
from tierstack.worker.jobs.gpt import GPTConfig
from tierstack.worker.jobs.partitioned_job import PartitionedSpec, RankResult

log = logging.getLogger(__name__)
console = Console()
EMBEDDED_OBJECT_STORE = 256 * MiB


def check_train_config(train: TrainConfig) -> None:
    """Refuse what partitioned ranks cannot do as configured; log what they place their own way.

    The ranks train with `ShardedEngine` as `PartitionedSpec` says: no accumulation (a
    setting that changes the arithmetic is an error), clipping by the global gradient's
    norm over every rank's shards, and every block's shards
    placed "auto" (the CPU pool keeps what fits, the rest on NVMe: a warning).
    """
    if train.gradient_accumulation_steps != 1:
        raise ConfigError(
            f"train.gradient_accumulation_steps is {train.gradient_accumulation_steps}: "
            f"partitioned training (--ranks, --address) does not accumulate over micro-batches "
            f"yet; set it to 1 and give the global batch with --batch-size")
    if train.lr_schedule.type != "none":
        raise ConfigError(f"train.lr_schedule {train.lr_schedule.type!r} (DeepSpeed: scheduler; "
                          f"--lr-schedule): partitioned training (--ranks, --address) has no "
                          f"learning-rate schedule yet; train on one rank, or drop the schedule")
    if train.precision == "fp16":
        raise ConfigError("train.precision 'fp16': partitioned training (--ranks, --address) has no "
                          "loss scaling yet; use bf16 or fp32, or train on one rank")
    placed = [f"train.params.device {train.params.device!r} (max_in_cpu {train.params.max_in_cpu})"
              if train.params.tier() != AUTO else "",
              f"train.optimizer_state.device {train.optimizer_state.device!r}"
              if train.optimizer_state.tier() not in (GPU, AUTO) else "",
              "train.tier_overrides" if train.tier_overrides else ""]
    if any(placed):
        log.warning("partitioned training places every block's shards 'auto' (the CPU pool keeps "
                    "what fits, the rest on NVMe); not applied: %s", ", ".join(p for p in placed if p))


def run(args: argparse.Namespace, config: TierstackConfig) -> int:
    check_train_config(config.train)
    require("cluster", "tierstack train --ranks/--address (its ranks are Ray actors)")
    import ray

    from tierstack.worker.jobs.ray_workers import start_local_ray, train_with_ray

    spec = PartitionedSpec(
        gpt=GPTConfig(seq_len=args.seq_len, dim=args.dim, layers=args.layers, heads=args.heads),
        steps=args.steps, global_batch=args.batch_size, seed=args.seed,
        optimizer=config.train.optimizer, precision=config.train.precision,
        gradient_clipping=config.train.gradient_clipping,
        activation_policy=config.train.activations.policy,
        partition_activations=config.train.activations.partition,
        device=args.device, job=f"train-{uuid.uuid4().hex[:8]}",
        device_budget=(parse_size(args.device_budget, "--device-budget") if args.device_budget
                       else config.train.device_budget))  # 0: the spec's layers' worth
    console.print(f"[bold]tierstack train[/]: GPT {args.layers} x {args.dim} over {args.ranks} "
                  f"data-parallel ranks (Ray actors), each keeping 1/{args.ranks} of every block; "
                  f"global batch {args.batch_size}")
    if args.address:
        from tierstack.worker.jobs.ray_auth import join_cluster_auth

        gcs = join_cluster_auth(args.address)  # before ray.init: a mismatch loses every actor
        ray.init(address=gcs, log_to_driver=True)
        try:
            return _report(train_with_ray(spec, args.ranks, placement=args.placement,
                                          on_placed=_print_dashboards), args)
        finally:
            ray.shutdown()
    if config.tier_manager.nvme_pool.size != "auto":  # a stated cap: at least 1 GiB ('auto': the disk's room)
        config.tier_manager.nvme_pool.size = max(config.tier_manager.nvme_pool.size, 1024 * MiB)
    with contextlib.ExitStack() as stack:
        # The node's services for every rank: the tier manager named, the node's, or one
        # started for the job with a scheduler beside it, whose plans rank 0 follows.
        services = open_services(
            stack, config, spec.job, tier_manager=args.tier_manager or "",
            tier_manager_setting="--tier-manager",
            scheduler=SchedulerUse.OFF if args.no_scheduler else SchedulerUse.AUTO,
            nvme_paths=[args.nvme_path] if args.nvme_path else None, nvme_setting="--nvme-path",
            cpu_pool_size=args.cpu_pool_size)
        spec.tier_manager, spec.scheduler = services.tier_manager, services.scheduler
        start_local_ray(max(args.ranks, os.cpu_count() or 1), EMBEDDED_OBJECT_STORE, log_to_driver=True)
        try:
            if services.started:
                _print_dashboards({"this machine": _http_endpoint(services.tier_manager)})
            return _report(train_with_ray(spec, args.ranks, placement=args.placement), args)
        finally:
            ray.shutdown()


def _http_endpoint(address: str) -> str:
    from tierstack.services.tier_manager.client import TierManagerClient

    client = TierManagerClient(address)
    try:
        return client.http_endpoint()
    finally:
        client.close()


def _print_dashboards(urls: dict[str, str]) -> None:
    """Each node's live dashboard, as its tier manager serves it (with how to trust its
    certificate where it serves TLS)."""
    for node, url in urls.items():
        if url:
            console.print(f"dashboard of {node}: {url}/dashboard/   Prometheus metrics: {url}/metrics",
                          soft_wrap=True)
    if any(url.startswith("https://") for url in urls.values()):
        ca = trusted_ca()
        console.print(f"  (TLS with the cluster's certificate: trust {ca or 'its ca.pem'}, e.g. "
                      f"`curl --cacert {ca or 'ca.pem'} URL/api/v1/node`)", soft_wrap=True)


def trusted_ca() -> str:
    """The CA file this process's clients trust ($TIERSTACK_SECURITY_DIR/ca.pem), or ''."""
    from tierstack.rpc import resolved_security

    security = resolved_security(None)
    return security.ca_file or security.cert_file


def _report(results: list[RankResult], args: argparse.Namespace) -> int:
    losses = [s.loss for s in results[0].steps]
    table = Table(title="per rank, per step (medians after the first step)")
    for column in ("rank", "node", "device", "step s", "CPU pool read MB", "node NVMe read MB",
                   "all-gather in MB"):
        table.add_column(column)
    for r in results:
        later = r.steps[1:] or r.steps
        med = lambda f: sorted(getattr(s, f) for s in later)[len(later) // 2]  # noqa: E731
        table.add_row(str(r.rank), r.node, r.device, f"{med('seconds'):.3f}",
                      f"{med('cpu_pool_read') / 1e6:.1f}", f"{med('nvme_read') / 1e6:.1f}",
                      f"{med('gathered') / 1e6:.1f}")
    console.print(table)
    seconds = sum(s.seconds for s in results[0].steps)
    tokens = args.batch_size * args.seq_len * len(losses)
    console.print(f"[bold]done[/]: {len(losses)} steps on {len(results)} ranks, loss {losses[0]:.3f} -> "
                  f"{losses[-1]:.3f}, {tokens / seconds:,.0f} tokens/s")
    return 0

