"""The `tierstack` command line: one subcommand per service or job.

The top room of the house (cli/ installs as tierstack.cli): it parses, then hands each
command to the room that runs it (jobs, daemons, the doctor); nothing imports it back."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from tierstack import arguments as types
from tierstack.config import GiB, MiB, load_config
from tierstack.errors import TierstackError

DESCRIPTION = """\
tierstack trains models whose state does not fit in GPU memory: parameters, gradients and
optimizer states live across GPU HBM, CPU DRAM and NVMe and stream to the GPU layer by
layer, ZeRO-Infinity style, run as services: a tier-manager daemon per node, a cluster
scheduler that plans placement and prefetching, and GPU workers (Ray actors)."""

EPILOG = """\
start with `tierstack doctor` (is this machine ready?) and `tierstack train` (a GPT, or
--hf-model DIR, with its state offloaded); `tierstack COMMAND --help` for each command."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with a bad flag reported in one line (and where to read more) instead of
    the usage block followed by the error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def _demo(args: argparse.Namespace) -> int:
    """Write and read tensors through both pools; print what each tier sustained."""
    import torch

    from tierstack.services.tier_manager.registry import TierRegistry, tensor_view

    config = load_config(args.config).tier_manager
    if args.nvme_path:
        config.nvme_pool.paths = args.nvme_path
    total, tensor_bytes = args.total, args.tensor_size
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
        config.nvme_pool.size = args.nvme_size
    if args.cpu_pool_size:
        config.cpu_pool.size = args.cpu_pool_size
    if args.shm_dir:
        config.cpu_pool.shm_dir = args.shm_dir
    if args.manifest:
        config.manifest_path = args.manifest
    if args.http_listen is not None:
        config.metrics.http_listen = args.http_listen
    config.validate()
    serve(config, loaded.security, recover=args.recover, parent_pid=args.exit_with_parent,
          owned_dir=args.owned_dir, preload_optimizer=args.preload_optimizer)
    return 0


def _scheduler(args: argparse.Namespace) -> int:
    """Run the cluster scheduler in the foreground."""
    from tierstack.services.scheduler.daemon import serve

    loaded = load_config(args.config)
    config = loaded.scheduler
    if args.listen:
        config.listen = args.listen
    config.validate()
    serve(config, loaded.security, parent_pid=args.exit_with_parent, owned_dir=args.owned_dir)
    return 0


def _exit_with_parent_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--exit-with-parent", metavar="PID", type=int,
                        help="shut down once process PID (the one that started the daemon) "
                             "is gone; tierstack's embedded daemons and Ray nodes' services "
                             "are started so")
    parser.add_argument("--owned-dir", metavar="DIR",
                        help="with --exit-with-parent: a directory made for this daemon alone, "
                             "removed when it shuts down because that process is gone")


def _plan(args: argparse.Namespace) -> int:
    """Estimate where a model's state lives and how fast it trains on a cluster."""
    from tierstack.services.scheduler.estimator import run_cli

    return run_cli(args)


JOBS_REACH_SECONDS = 1.0
"""How long `tierstack jobs` gives a TCP tier manager to accept a connection (a unix socket
is answered at once: it is there and accepts, or not) before saying none is there, instead
of the client's 10 s wait for a daemon that restarts."""


def _jobs(args: argparse.Namespace) -> int:
    """List the jobs a tier manager holds state for and what killed runs left on the disks,
    or delete one job's tensors, or remove what killed runs left (--clean).

    Exit 0 whenever the listing was made, also with no tier manager there: none running is
    an answer (no job is served here), said in one line. A tier manager that accepts but
    fails the call, or --delete with none there, is an error (2)."""
    if args.clean:
        return _clean_dead_runs()
    from tierstack.addresses import TIER_MANAGER_ENV, default_tier_manager_address

    address = args.tier_manager or default_tier_manager_address()
    absent = _why_no_tier_manager(address)
    if absent:
        if args.delete:
            from tierstack.errors import TierManagerUnavailableError

            raise TierManagerUnavailableError(
                f"no tier manager at {address} ({absent}): job {args.delete}'s tensors are "
                f"deleted by the daemon that holds them; start it (`tierstack tier-manager`) "
                f"or name it with --tier-manager ADDRESS")
        print(f"no tier manager at {address} ({absent}); start one with `tierstack "
              f"tier-manager`, or name yours with --tier-manager ADDRESS or ${TIER_MANAGER_ENV}")
    else:
        from tierstack.services.tier_manager.client import TierManagerClient

        client = TierManagerClient(address, reconnect_timeout=10)
        try:
            if args.delete:
                deleted = client.delete_job(args.delete, force=args.force)
                print(f"job {args.delete}: {deleted} tensors deleted")
                return 0
            jobs = client.jobs()
        finally:
            client.close()
        print(f"{'job':24} {'tensors':>8} {'MiB':>10} {'workers':>7}  state")
        for j in jobs:
            state = ("kept" if j.keep else "not managed (kept)" if not j.managed
                     else "open" if j.workers else f"deleted in {j.delete_in_seconds:.0f} s")
            quota = f", quota {j.quota_bytes / 2**20:.0f} MiB" if j.quota_bytes else ""
            print(f"{j.job:24} {j.tensors:8d} {j.bytes / 2**20:10.1f} {j.workers:7d}  {state}{quota}")
    _list_dead_runs()
    return 0


def _why_no_tier_manager(address: str) -> str:
    """Why no tier manager could answer at `address` now, '' when one listens: asked before
    any call, which would wait its 10 s for a daemon that restarts. A unix socket is
    looked at without importing gRPC (a third of a second of this command)."""
    from tierstack.addresses import grpc_target, unix_socket_path, unix_socket_unserved

    socket_path = unix_socket_path(grpc_target(address))
    if socket_path is not None:
        return unix_socket_unserved(socket_path, JOBS_REACH_SECONDS)
    from tierstack.services.tier_manager.client import TierManagerClient

    client = TierManagerClient(address)
    try:
        return client.why_not_listening(JOBS_REACH_SECONDS)
    finally:
        client.close()


def _list_dead_runs() -> None:
    """What killed runs left on this machine's disks (the run index `tierstack doctor`
    reads), and how to remove it."""
    from tierstack.run_index import dead_runs

    dead = dead_runs()
    if not dead:
        print("runs left behind: none")
        return
    print(f"runs left behind: {len(dead)} run(s) ended without cleaning up their NVMe state "
          f"(`tierstack jobs --clean` removes it):")
    now = time.time()
    for _, record in dead:
        print(f"  {record.describe(now)}")


def _clean_dead_runs() -> int:
    """Remove what runs that were killed left on the disks (tierstack/run_index.py); needs
    no tier manager."""
    from tierstack.run_index import dead_runs, remove_dead_run

    dead = dead_runs()
    for index, record in dead:
        size = record.nbytes()
        remove_dead_run(index, record)
        print(f"job {record.job} (pid {record.pid}): removed {', '.join(record.directories)} "
              f"({size / GiB:.2f} GiB)")
    if not dead:
        print("no killed run left state behind")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    """Check this machine for tierstack; exit 1 when something needs fixing."""
    from tierstack.doctor import run_cli

    return run_cli(args)


def _zero_to_fp32(args: argparse.Namespace) -> int:
    """Write a checkpoint's fp32 weights, then say what was written (DeepSpeed's spellings
    of the flags are taken too: --safe_serialization, --max_shard_size, -t)."""
    from tierstack.checkpoint_layout import find
    from tierstack.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    files = convert_zero_checkpoint_to_fp32_state_dict(
        args.checkpoint_dir, args.output_dir, max_shard_size=args.max_shard_size,
        safe_serialization=args.safetensors, tag=args.tag,
        exclude_frozen_parameters=args.exclude_frozen_parameters)
    total = sum(f.stat().st_size for f in files)
    print(f"tierstack zero-to-fp32: {find(args.checkpoint_dir, args.tag)} -> {args.output_dir}: "
          f"{', '.join(f.name for f in files)} ({total / 1e6:,.1f} MB)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="tierstack", description=DESCRIPTION, epilog=EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser("train", help="train a model with its state offloaded (the main job)",
                           description=_doc("tierstack.worker.jobs.train_job"))
    from tierstack.worker.jobs.train_flags import add_arguments, run as run_train
    add_arguments(train)
    train.set_defaults(func=run_train)

    launch = sub.add_parser("launch", help="run your own training script (tierstack.initialize) "
                                           "with the node's services around it",
                            description=_doc("tierstack.worker.jobs.launch"))
    from tierstack.worker.jobs.launch import add_arguments as add_launch, run as run_launch
    add_launch(launch)
    launch.set_defaults(func=run_launch)

    doctor = sub.add_parser("doctor", help="check this machine: NVMe paths, memory, pinning, GPU, bandwidth",
                            description=_doc("tierstack.doctor"))
    from tierstack.doctor import add_arguments as add_doctor_arguments
    add_doctor_arguments(doctor)
    doctor.set_defaults(func=_doctor)

    plan = sub.add_parser("plan", help="estimate placement, step time and TFLOP/s of a model on a cluster",
                          description=_doc("tierstack.services.scheduler.estimator"))
    from tierstack.services.scheduler.estimator import add_arguments as add_plan_arguments
    add_plan_arguments(plan)
    plan.set_defaults(func=_plan)

    fp32 = sub.add_parser("zero-to-fp32", help="write a checkpoint's fp32 weights for from_pretrained "
                                               "(offline: no tier manager, no model code)",
                          description=_doc("tierstack.utils.zero_to_fp32"))
    fp32.add_argument("checkpoint_dir", metavar="CKPT_DIR",
                      help="the directory save_checkpoint or --checkpoint-dir wrote (its `latest` tag "
                           "is read), or one tag's directory")
    fp32.add_argument("output_dir", metavar="OUT",
                      help="the directory to write the fp32 weights (and config.json) into")
    fp32.add_argument("-t", "--tag", help="the tag to read (default: the one `latest` names)")
    fp32.add_argument("--safetensors", "--safe_serialization", dest="safetensors", action="store_true",
                      help="write model.safetensors (default: pytorch_model.bin, torch.save's format)")
    fp32.add_argument("--max-shard-size", "--max_shard_size", dest="max_shard_size", default="5GB",
                      type=types.positive_size, metavar="BYTES",
                      help="bytes per file before the weights are split in shards with an index "
                           "(default 5GB); memory holds one shard")
    fp32.add_argument("--exclude-frozen-parameters", "--exclude_frozen_parameters",
                      dest="exclude_frozen_parameters", action="store_true",
                      help="leave out the parameters that did not train")
    fp32.set_defaults(func=_zero_to_fp32)

    tm = sub.add_parser("tier-manager", help="run this node's tier-manager daemon (gRPC) in the foreground",
                        description=_doc("tierstack.services.tier_manager.daemon"))
    tm.add_argument("--config", help="tierstack JSON config (its tier_manager section)")
    tm.add_argument("--listen", help="unix:/path/to.sock (default: $TIERSTACK_TIER_MANAGER or a "
                                     "per-user socket under /tmp) or host:port")
    tm.add_argument("--cpu-pool-size", type=types.positive_size, help="CPU pool bytes, e.g. 16GiB")
    tm.add_argument("--shm-dir", help="directory of the CPU pool's arenas (a tmpfs, default /dev/shm)")
    tm.add_argument("--nvme-path", action="append", help="NVMe pool directory (repeatable: one per drive)")
    tm.add_argument("--nvme-size", type=types.positive_size, help="NVMe pool bytes over all paths, e.g. 512GiB")
    tm.add_argument("--manifest", help="path of the manifest database (default: in the first NVMe path)")
    tm.add_argument("--http-listen", metavar="HOST:PORT",
                    help="where metrics, the HTTP API and the dashboard are served (default "
                         "127.0.0.1:8470; a taken port falls back to a free one; '' for none)")
    tm.add_argument("--recover", action="store_true",
                    help="rebuild a lost or corrupt manifest from the NVMe data (every extent "
                         "describes itself), keeping the old one aside, then serve")
    tm.add_argument("--preload-optimizer", action="store_true",
                    help="make the CPU AdamW (and import torch, about 2 s) as soon as it serves, "
                         "not on the first optimizer step (what a daemon started for a training "
                         "job does)")
    _exit_with_parent_flag(tm)
    tm.set_defaults(func=_tier_manager)

    sched = sub.add_parser("scheduler", help="run the cluster scheduler (gRPC): plans from traces and bandwidth",
                           description=_doc("tierstack.services.scheduler.daemon"))
    sched.add_argument("--config", help="tierstack JSON config (its scheduler section)")
    sched.add_argument("--listen", help="unix:/path/to.sock (default: $TIERSTACK_SCHEDULER or a "
                                        "per-user socket under /tmp) or host:port")
    _exit_with_parent_flag(sched)
    sched.set_defaults(func=_scheduler)

    jobs = sub.add_parser("jobs", help="list the jobs a tier manager keeps state for and the runs "
                                       "left behind, or delete one's",
                          description="A job's tensors go when its last worker does, unless it "
                                      "asked to keep them; this lists every job on the node (or "
                                      "says at once that no tier manager is there) and what "
                                      "killed runs left on the disks, and deletes one job's "
                                      "tensors on request. --clean removes what killed runs "
                                      "left; it needs no tier manager. Exit status 0 when the "
                                      "list was made, with or without a tier manager; 2 when "
                                      "one is there but fails, or --delete finds none.")
    jobs.add_argument("--tier-manager", metavar="ADDRESS",
                      help="the tier manager (default: $TIERSTACK_TIER_MANAGER or the per-user socket)")
    what = jobs.add_mutually_exclusive_group()
    what.add_argument("--delete", metavar="JOB", help="delete this job's tensors now")
    jobs.add_argument("--force", action="store_true",
                      help="with --delete: even while workers hold the job open")
    what.add_argument("--clean", action="store_true",
                      help="remove the NVMe state that killed runs left on this machine's disks "
                           "(`tierstack doctor` lists it)")
    jobs.set_defaults(func=_jobs)

    ray_node = sub.add_parser("ray-node", help="this Ray node's tierstack services (started by deploy/cluster.yaml)",
                              description=_doc("tierstack.deploy.ray_node"))
    from tierstack.deploy.ray_node import add_arguments as add_ray_node, run as run_ray_node
    add_ray_node(ray_node)
    ray_node.set_defaults(func=run_ray_node)

    local = sub.add_parser("local-cluster", help="deploy/cluster-local.yaml on this machine: two loopback "
                           "nodes over a local sshd (up), and everything removed again (down)",
                           description=_doc("tierstack.deploy.local_cluster"))
    from tierstack.deploy.local_cluster import add_arguments as add_local_cluster, run as run_local_cluster
    add_local_cluster(local)
    local.set_defaults(func=run_local_cluster)

    demo = sub.add_parser("demo", help="write and read tensors through the CPU and NVMe pools, verified",
                          description=_demo.__doc__)
    demo.add_argument("--config", help="tierstack JSON config (defaults otherwise)")
    demo.add_argument("--nvme-path", action="append", help="NVMe pool directory (repeatable)")
    demo.add_argument("--total", type=types.positive_size, default="1GiB",
                      help="bytes to move through each tier (default 1GiB)")
    demo.add_argument("--tensor-size", type=types.positive_size, default="64MiB",
                      help="bytes per tensor (default 64MiB)")
    demo.set_defaults(func=_demo)
    return parser


def _doc(module: str) -> str:
    """The first paragraph of a module's docstring (a command's description in --help),
    read without importing the module (a daemon's imports are heavy)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return ""
    with open(spec.origin, encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    return doc.split("\n\n")[0].replace("\n", " ")


def whole_lines() -> None:
    """Make each line leave this process's stdout and stderr in one write.

    Under PYTHONUNBUFFERED (python -u, and many CI and container set-ups) print() writes
    its text and then its newline, two writes; a log line another thread wrote between
    them (the plan watcher's) landed inside the printed line when both streams share a pipe
    (`tierstack train 2>&1 | cat`: "...; trace)INFO ...: plan v2 ...", then an empty line).
    Line buffering without write-through still sends every line out as soon as it ends.
    Streams that are not the interpreter's own (a test's capture) are left as they are."""
    for stream, own in ((sys.stdout, sys.__stdout__), (sys.stderr, sys.__stderr__)):
        if stream is own and stream is not None and getattr(stream, "write_through", False):
            stream.reconfigure(line_buffering=True, write_through=False)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    whole_lines()
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except TierstackError as e:  # the user's to fix: one line, no traceback
        print(f"tierstack: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tierstack: interrupted", file=sys.stderr)
        return 130

