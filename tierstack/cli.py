"""The `tierstack` command line. Subcommands are added here as the services grow."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from tierstack.config import GiB, MiB, load_config, parse_size
from tierstack.errors import TierstackError


def _demo(args: argparse.Namespace) -> int:
    """Write and read tensors through both pools; print what each tier sustained."""
    import torch

    from tierstack.services.tier_manager.registry import TierRegistry, tensor_view

    config = load_config(args.config).tier_manager
    if args.nvme_path:
        config.nvme_pool.paths = args.nvme_path
    total = parse_size(args.total, "--total")
    tensor_bytes = parse_size(args.tensor_size, "--tensor-size")
    if config.nvme_pool.size != "auto":  # a stated cap must hold what the demo writes
        config.nvme_pool.size = max(config.nvme_pool.size, 2 * total)
    count = max(1, total // tensor_bytes)
    torch.manual_seed(0)
    tensors = [torch.randn(tensor_bytes // 4) for _ in range(min(count, 4))]
    rows = []
    with TierRegistry(config) as registry:
        print(f"tier manager: CPU pool up to {registry.cpu_pool.capacity / GiB:.1f} GiB at "
              f"{config.cpu_pool.shm_dir}; NVMe pool up to "
              f"{registry.nvme_pool.capacity / GiB:.1f} GiB at {', '.join(config.nvme_pool.paths)} "
              f"(O_DIRECT: {'yes' if registry.nvme_pool.direct_io else 'no'})")
        for tier in ("nvme", "cpu"):
            keys = [f"demo/{tier}/{i}" for i in range(count)]
            start = time.perf_counter()
            for i, key in enumerate(keys):
                registry.put(key, tensors[i % len(tensors)], tier=tier)
            write_s = time.perf_counter() - start
            if tier == "nvme":
                start = time.perf_counter()
                for key in keys:
                    info, buffer = registry.fetch(key)  # NVMe -> CPU pool, checksums verified
                    registry.release(key)
                    registry.evict(key)
                read_s = time.perf_counter() - start
            else:
                start = time.perf_counter()
                for key in keys:
                    registry.get(key)
                read_s = time.perf_counter() - start
            for i, key in enumerate(keys):
                info, buffer = registry.fetch(key)
                ok = torch.equal(tensor_view(registry, info, buffer), tensors[i % len(tensors)])
                registry.release(key)
                if not ok:
                    print(f"MISMATCH in {key}", file=sys.stderr)
                    return 1
                registry.delete(key)
            moved = count * tensor_bytes
            rows.append((tier, moved, moved / write_s / 1e9, moved / read_s / 1e9))
    print(f"{'tier':6} {'bytes':>10} {'write GB/s':>11} {'read GB/s':>10}")
    for tier, moved, w, r in rows:
        print(f"{tier:6} {moved / MiB:>7.0f} MiB {w:>11.2f} {r:>10.2f}")
    print("every byte verified after the round trip")
    return 0


def _tier_manager(args: argparse.Namespace) -> int:
    """Run this node's tier-manager daemon in the foreground."""
    from tierstack.services.tier_manager.daemon import serve

    loaded = load_config(args.config)
    config = loaded.tier_manager
    if args.listen:
        config.listen = args.listen
    if args.nvme_path:
        config.nvme_pool.paths = args.nvme_path
    if args.nvme_size:
        config.nvme_pool.size = parse_size(args.nvme_size, "--nvme-size")
    if args.cpu_pool_size:
        config.cpu_pool.size = parse_size(args.cpu_pool_size, "--cpu-pool-size")
    if args.shm_dir:
        config.cpu_pool.shm_dir = args.shm_dir
    if args.manifest:
        config.manifest_path = args.manifest
    config.validate()
    serve(config, loaded.security, recover=args.recover)
    return 0


def _scheduler(args: argparse.Namespace) -> int:
    """Run the cluster scheduler in the foreground."""
    from tierstack.services.scheduler.daemon import serve

    loaded = load_config(args.config)
    config = loaded.scheduler
    if args.listen:
        config.listen = args.listen
    config.validate()
    serve(config, loaded.security)
    return 0


def _plan(args: argparse.Namespace) -> int:
    """Estimate where a model's state lives and how fast it trains on a cluster."""
    from tierstack.services.scheduler.estimator import run_cli

    return run_cli(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierstack", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="write and read tensors through the CPU and NVMe pools")
    demo.add_argument("--config", help="tierstack JSON config (defaults otherwise)")
    demo.add_argument("--nvme-path", action="append", help="NVMe pool directory (repeatable)")
    demo.add_argument("--total", default="1GiB", help="bytes to move through each tier")
    demo.add_argument("--tensor-size", default="64MiB", help="bytes per tensor")
    demo.set_defaults(func=_demo)

    train = sub.add_parser("train", help="train a byte-level GPT with its state offloaded (the main job)")
    from tierstack.worker.jobs.train_job import add_arguments, run as run_train
    add_arguments(train)
    train.set_defaults(func=run_train)

    tm = sub.add_parser("tier-manager", help="run this node's tier-manager daemon (gRPC)")
    tm.add_argument("--config", help="tierstack JSON config (its tier_manager section)")
    tm.add_argument("--listen", help="unix:/path/to.sock (default) or host:port")
    tm.add_argument("--cpu-pool-size", help="CPU pool bytes, e.g. 16GiB")
    tm.add_argument("--shm-dir", help="directory of the CPU pool's arenas (a tmpfs)")
    tm.add_argument("--nvme-path", action="append", help="NVMe pool directory (repeatable)")
    tm.add_argument("--nvme-size", help="NVMe pool bytes over all paths, e.g. 512GiB")
    tm.add_argument("--manifest", help="path of the manifest database")
    tm.add_argument("--recover", action="store_true",
                    help="rebuild a lost or corrupt manifest from the NVMe data (every extent "
                         "describes itself), keeping the old one aside, then serve")
    tm.set_defaults(func=_tier_manager)

    ray_node = sub.add_parser("ray-node", help="this Ray node's tierstack services (deploy/cluster.yaml)")
    from tierstack.deploy.ray_node import add_arguments as add_ray_node, run as run_ray_node
    add_ray_node(ray_node)
    ray_node.set_defaults(func=run_ray_node)
    sched = sub.add_parser("scheduler", help="run the cluster scheduler (gRPC): plans from traces and bandwidth")
    sched.add_argument("--config", help="tierstack JSON config (its scheduler section)")
    sched.add_argument("--listen", help="unix:/path/to.sock (default) or host:port")
    sched.set_defaults(func=_scheduler)

    plan = sub.add_parser("plan", help="estimate placement, step time and TFLOP/s of a model on a cluster")
    from tierstack.services.scheduler.estimator import add_arguments as add_plan_arguments
    add_plan_arguments(plan)
    plan.set_defaults(func=_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except TierstackError as e:
        print(f"tierstack: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
