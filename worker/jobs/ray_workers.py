"""GPU workers as Ray actors: one rank per actor, placed by Ray, trained by `run_rank`.

`train_with_ray(spec, ranks)` reserves one bundle per rank in a placement group (a GPU
each when the cluster has enough, else a CPU: the tests' CPU-only actors), starts a
`RankActor` in each, gives them torchrun's environment (rank 0's node address and a
free port there as MASTER_ADDR/PORT), and runs `partitioned_job.run_rank` in all of
them at once. Each actor talks to its own node's tier manager: the one `tierstack
ray-node` runs next to the node's raylet (deploy/cluster.yaml), found from the actor's
node IP and its cluster's GCS address (another cluster may have a node on the same host),
unless the caller passes one address for all (a single machine).

Why actors with our own process group rather than Ray Train's TorchTrainer: the rank
code must also run where there is no Ray (the GPU machine: torchrun or the plain
launcher), so it owns its torch.distributed set-up either way; TorchTrainer would add
ray[train]'s dependencies, its own run/checkpoint storage and a second way of setting up
the same process group, for nothing the actors need. Placement and GPU assignment, the
parts Ray is good at, still come from Ray (placement groups, num_gpus=1 per actor).
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tierstack.addresses import node_tier_manager_address
from tierstack.errors import InvalidArgumentError, TierstackError
from tierstack.process_tree import children, kill_tree
from tierstack.worker.node.distributed import RankEnv, free_port
from tierstack.worker.jobs.partitioned_job import PartitionedSpec, RankResult, run_rank
from tierstack.worker.jobs.ray_auth import local_ray_auth

log = logging.getLogger(__name__)

PLACEMENTS = ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK")
RAY_START_ATTEMPTS = 3
_RAY_START_TIMEOUT = "timed out during startup"
"""Ray's message when its raylet did not register with its GCS within Ray's fixed 30 s."""


class RayStartError(TierstackError):
    """Ray did not start on this machine."""

    grpc_status = "UNAVAILABLE"


def start_local_ray(num_cpus: int, object_store_memory: int, attempts: int = RAY_START_ATTEMPTS,
                    **init_kwargs) -> None:
    """`ray.init` of a Ray of this process's own (address "local": never one another
    process started here), tried again when its node misses Ray's start-up deadline.

    Ray gives a new node a fixed 30 s for the raylet to register with the GCS; on a busy
    2-core machine a start has taken longer (CI, where the suite's own processes compete).
    A failed start leaves its GCS, raylet and helpers running with nothing to stop them
    (`ray.shutdown` knows only a node that started), so they are killed, every process
    this one started during the try, before the next try."""
    local_ray_auth()
    for attempt in range(1, attempts + 1):
        before = set(children(os.getpid()))
        try:
            ray.init(address="local", num_cpus=num_cpus, object_store_memory=object_store_memory,
                     include_dashboard=False, **init_kwargs)
            return
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this
            if _RAY_START_TIMEOUT not in str(e):
                raise
            for pid in set(children(os.getpid())) - before:
                kill_tree(pid)
            ray.shutdown()
            if attempt == attempts:
                raise RayStartError(
                    f"Ray did not start on this machine: {attempts} tries, each past Ray's 30 s "
                    f"for its raylet to register with its GCS. The machine may be overloaded "
                    f"(see `uptime`) or Ray's processes failing (logs under "
                    f"/tmp/ray/session_latest/logs); retry when it is quieter") from e
            log.warning("Ray's node missed its start-up deadline (try %d of %d, the machine is "
                        "busy?); its processes were stopped, starting again", attempt, attempts)


@ray.remote
class RankActor:
    """One data-parallel rank, on the node and GPU Ray placed it on."""

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        return free_port(ray.util.get_node_ip_address())

    def dashboard_url(self, spec: PartitionedSpec) -> str:
        """The HTTP URL of the tier manager this rank will use, or '' (none, or it serves none)."""
        from tierstack.services.tier_manager.client import TierManagerClient

        if spec.embedded is not None:
            return ""
        client = TierManagerClient(spec.tier_manager or node_tier_manager_address(
            ray.util.get_node_ip_address(), ray.get_runtime_context().gcs_address),
            reconnect_timeout=5.0)
        try:
            return client.http_endpoint()
        finally:
            client.close()

    def run(self, env: RankEnv, spec: PartitionedSpec) -> RankResult:
        if spec.tier_manager is None and spec.embedded is None:
            spec.tier_manager = node_tier_manager_address(ray.util.get_node_ip_address(),
                                                          ray.get_runtime_context().gcs_address)
        result = run_rank(env, spec)
        result.node = ray.util.get_node_ip_address()
        return result


def train_with_ray(spec: PartitionedSpec, ranks: int, use_gpu: bool | None = None,
                   placement: str = "SPREAD", timeout: float | None = None,
                   on_placed: Callable[[dict[str, str]], None] | None = None) -> list[RankResult]:
    """Train `spec` on `ranks` Ray actors of the connected cluster; results by rank.
    `on_placed` gets each node's dashboard URL ('' for none) once the ranks are placed."""
    if not ray.is_initialized():
        raise InvalidArgumentError("connect to Ray first (ray.init) or use `tierstack train --ranks N`")
    if placement not in PLACEMENTS:
        raise InvalidArgumentError(f"placement {placement!r}: use one of {', '.join(PLACEMENTS)}")
    if ranks < 1:
        raise InvalidArgumentError(f"ranks must be at least 1, got {ranks}")
    resources = ray.cluster_resources()
    if use_gpu is None:
        use_gpu = resources.get("GPU", 0) >= ranks
    bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
    for name, need in bundle.items():
        if resources.get(name, 0) < need * ranks:
            raise InvalidArgumentError(
                f"{ranks} ranks need {need * ranks:g} {name} but the Ray cluster has "
                f"{resources.get(name, 0):g}; use fewer --ranks or add nodes")
    group = placement_group([dict(bundle)] * ranks, strategy=placement)
    try:
        if not _wait(group.ready(), timeout or 300):
            raise InvalidArgumentError(
                f"Ray could not place {ranks} ranks of {bundle} with strategy {placement} within "
                f"{timeout or 300:.0f} s (cluster: {resources}); check `ray status`")
        actors = [RankActor.options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=r),
        ).remote() for r in range(ranks)]
        master = ray.get(actors[0].node_ip.remote())
        port = ray.get(actors[0].free_port.remote())
        nodes = ray.get([a.node_ip.remote() for a in actors])
        log.info("ranks on nodes %s; rendezvous at %s:%d", nodes, master, port)
        if on_placed is not None:
            urls = ray.get([a.dashboard_url.remote(spec) for a in actors])
            on_placed({f"node {node}": url for node, url in zip(nodes, urls)})
        # LOCAL_RANK 0: Ray gives each actor exactly one GPU (CUDA_VISIBLE_DEVICES).
        envs = [RankEnv(r, ranks, 0, master, port) for r in range(ranks)]
        results = ray.get([a.run.remote(env, spec) for a, env in zip(actors, envs)], timeout=timeout)
        for actor in actors:
            ray.kill(actor)
        return sorted(results, key=lambda r: r.rank)
    finally:
        remove_placement_group(group)


def _wait(ref, timeout: float) -> bool:
    ready, _ = ray.wait([ref], timeout=timeout)
    return bool(ready)
