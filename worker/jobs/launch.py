"""`tierstack launch script.py [args]`: the user's own training script with the node's
services around it, as `deepspeed script.py` or `torchrun script.py` runs one.

The launcher finds the node's services as every door does (worker/job.py): the tier
manager named (--tier-manager), else the node's ($TIERSTACK_TIER_MANAGER or the per-user
socket, when one answers), else the embedded single-node default: a scheduler and a tier
manager registered with it, the tier manager's NVMe pool in a directory named after the
job under the config's NVMe paths (--nvme-path, else a DeepSpeed JSON's nvme_path, else
the one default root, /var/tmp/tierstack-<uid>/nvme). The script runs with
$TIERSTACK_TIER_MANAGER, $TIERSTACK_SCHEDULER and $TIERSTACK_JOB set, so its
`tierstack.initialize` uses them and follows that scheduler's plans; with --config,
$TIERSTACK_CONFIG names the file too.

The `deepspeed` launcher's flags choose the ranks, all on this machine: `--num_gpus N`
starts N processes with torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), whose `initialize` joins them into one
partitioned job over the node's one tier manager (NCCL, rank r on GPU r; on a machine
without GPUs, gloo ranks on the CPU); `--include` / `--exclude` (`localhost:0,2`) pick the
GPUs (CUDA_VISIBLE_DEVICES), a hostfile may name this machine only, `--master_addr` and
`--master_port` (default: a free port) place the rendezvous. The script gets LOCAL_RANK in
its environment, not a `--local_rank` argument (DeepSpeed's `--no_local_rank`, always).
Several nodes (`--num_nodes` > 1, a hostfile or `--include` naming other hosts) are
refused in one line naming what does it: torchrun on each node, or a Ray cluster.

Every exit path cleans up: the ranks' exit (the first failing rank's code is the
launcher's; the other ranks are stopped then), Ctrl-C (the ranks, in the same process
group, get it themselves; the launcher waits for them), SIGTERM to the launcher (passed on
to every rank, then waited for), and a launcher killed outright (the daemons exit with
their parent). The daemons are stopped and the job's directories removed afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tierstack import arguments as types
from tierstack.addresses import JOB_ENV, SCHEDULER_ENV, TIER_MANAGER_ENV
from tierstack.config import LoadedConfig, load_config_with_keys
from tierstack.errors import ConfigError

CONFIG_ENV = "TIERSTACK_CONFIG"
"""The config file `tierstack launch --config` was given, for the script to read."""

RANK_STOP_SECONDS = 30.0
"""How long the other ranks of a failed one get to end after SIGTERM, before SIGKILL."""

# One line for what the launcher does not do: ranks on other machines.
MULTI_NODE = ("tierstack launch starts ranks on this machine only; on several nodes run "
              "`torchrun --nnodes N --nproc_per_node G --rdzv_endpoint HOST:PORT script.py` on "
              "each (the script's initialize joins the ranks, each node's tier manager holds its "
              "ranks' shards), or train on a Ray cluster (`ray up deploy/cluster.yaml`, then "
              "`tierstack train --address auto --ranks N`)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="a tierstack or DeepSpeed JSON: the embedded tier "
                                         "manager's pools and NVMe paths (and $TIERSTACK_CONFIG "
                                         "for the script)")
    parser.add_argument("--nvme-path", default=None,
                        help="directory for the embedded tier manager's NVMe pool (a "
                             "subdirectory named after the job is used and removed); default: "
                             "the config's NVMe paths, else /var/tmp/tierstack-<uid>/nvme")
    parser.add_argument("--tier-manager", metavar="ADDRESS",
                        help="use this running tier manager instead of finding or starting one")
    parser.add_argument("--no-scheduler", action="store_true",
                        help="start no scheduler with the embedded tier manager")
    parser.add_argument("--job", help="the job's name on the node (default: the script's name "
                                      "and the launcher's pid)")
    ds = parser.add_argument_group(
        "the deepspeed launcher's flags", "ranks on this machine, with torchrun's variables; "
        "several nodes are refused, naming what does it")
    ds.add_argument("--num_gpus", "--num-gpus", type=types.positive_int, metavar="N",
                    help="ranks to start (one per GPU; on a machine without GPUs, gloo ranks "
                         "on the CPU); default: one rank, or the GPUs --include/--exclude leave")
    ds.add_argument("--num_nodes", "--num-nodes", type=types.positive_int, metavar="N",
                    help="1 (this machine); more is refused, naming what does it")
    ds.add_argument("-i", "--include", default="", metavar="HOST[:GPU,...]",
                    help="the GPUs to use, DeepSpeed's form: localhost:0,2 (this machine only)")
    ds.add_argument("-e", "--exclude", default="", metavar="HOST[:GPU,...]",
                    help="GPUs not to use, DeepSpeed's form: localhost:1")
    ds.add_argument("-H", "--hostfile", metavar="FILE",
                    help="DeepSpeed's hostfile ('host slots=N' lines): this machine only; its "
                         "slots are the ranks")
    ds.add_argument("--master_addr", "--master-addr", default="127.0.0.1", metavar="ADDRESS",
                    help="the ranks' rendezvous address (MASTER_ADDR; default 127.0.0.1)")
    ds.add_argument("--master_port", "--master-port", type=types.positive_int, metavar="PORT",
                    help="the ranks' rendezvous port (MASTER_PORT; default: a free port)")
    ds.add_argument("--no_local_rank", "--no-local-rank", action="store_true",
                    help="accepted: the script never gets --local_rank (LOCAL_RANK is in its "
                         "environment)")
    parser.add_argument("script", help="the Python training script to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER,
                        help="arguments passed to the script as they are")


@dataclass(frozen=True)
class Ranks:
    """The processes the launcher starts: how many, on which GPUs, where they meet."""

    count: int
    gpus: tuple[int, ...] | None
    """The GPUs the ranks use (CUDA_VISIBLE_DEVICES), None: as the machine has them."""
    master_addr: str
    master_port: int

    def environ(self, rank: int) -> dict[str, str]:
        """Rank `rank`'s torchrun variables (none for a single rank: a plain run)."""
        if self.count == 1 and self.gpus is None:
            return {}
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, self.gpus))} if self.gpus is not None else {}
        if self.count > 1:
            env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.count),
                        "LOCAL_WORLD_SIZE": str(self.count), "MASTER_ADDR": self.master_addr,
                        "MASTER_PORT": str(self.master_port)})
        return env

    def describe(self, gpu_count: int) -> str:
        if self.count == 1:
            return "1 rank" + (f" on GPU {self.gpus[0]}" if self.gpus else "")
        where = (f"GPUs {','.join(map(str, self.gpus))}" if self.gpus is not None else
                 f"GPUs 0-{self.count - 1}" if gpu_count else "the CPU (gloo)")
        return f"{self.count} ranks on {where}, meeting at {self.master_addr}:{self.master_port}"


def run(args: argparse.Namespace) -> int:
    """Run the script's ranks with the services around them; the launcher's exit code."""
    script = Path(args.script)
    if not script.is_file():
        raise ConfigError(f"launch: {script} is not a file; give the training script to run "
                          f"(e.g. tierstack launch train.py --epochs 1)")
    ranks, gpu_count = _ranks(args)
    loaded = load_config_with_keys(args.config, world_size=ranks.count)
    job = args.job or f"{script.stem}-{os.getpid()}"
    env = {**os.environ, JOB_ENV: job}
    if args.config:
        env[CONFIG_ENV] = str(Path(args.config).resolve())
    with contextlib.ExitStack() as services:
        env.update(_services(args, loaded, job, services, ranks.describe(gpu_count)))
        return _run_ranks(script, args.script_args, env, ranks)


# ---- the ranks: the deepspeed launcher's flags ---------------------------------------------


def _ranks(args: argparse.Namespace) -> tuple[Ranks, int]:
    """The ranks the flags ask for on this machine, and its GPU count (0 when none was
    needed to decide); a flag reaching beyond this machine is refused (MULTI_NODE)."""
    if args.num_nodes is not None and args.num_nodes > 1:
        raise ConfigError(f"--num_nodes {args.num_nodes}: {MULTI_NODE}")
    if (args.include or args.exclude) and args.num_gpus is not None:
        raise ConfigError("--num_gpus with --include/--exclude: give one of them (DeepSpeed "
                          "refuses both too); --include localhost:0,1 names the GPUs to use")
    if args.include and args.exclude:
        raise ConfigError("--include and --exclude: give one of them")
    slots = _hostfile_slots(Path(args.hostfile)) if args.hostfile else None
    port = args.master_port or _free_port(args.master_addr)
    if args.include or args.exclude:
        flag, spec = ("--include", args.include) if args.include else ("--exclude", args.exclude)
        named = _named_gpus(flag, spec)  # hosts checked before torch counts the GPUs
        gpu_count = _gpu_count()
        gpus = _pick_gpus(flag, spec, named, gpu_count, keep=bool(args.include))
        return Ranks(len(gpus), gpus, args.master_addr, port), gpu_count
    count = args.num_gpus or slots or 1
    gpu_count = _gpu_count() if count > 1 else 0
    if gpu_count and count > gpu_count:
        raise ConfigError(f"--num_gpus {count}: this machine has {gpu_count} GPU"
                          f"{'s' if gpu_count > 1 else ''}; start at most {gpu_count} ranks")
    return Ranks(count, None, args.master_addr, port), gpu_count


def _is_this_machine(host: str) -> bool:
    return host in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn())


def _hostfile_slots(path: Path) -> int | None:
    """The slots a DeepSpeed hostfile gives this machine (None: it gives none); a host
    other than this machine is refused (MULTI_NODE)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"--hostfile {path}: cannot read it ({e.strerror})") from None
    slots = None
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        host, _, rest = line.partition(" ")
        if not _is_this_machine(host):
            raise ConfigError(f"--hostfile {path} names {host} (line {number}): {MULTI_NODE}")
        rest = rest.strip()
        if rest:
            if not rest.startswith("slots=") or not rest[6:].isdigit() or int(rest[6:]) < 1:
                raise ConfigError(f"--hostfile {path} line {number}: {line!r} is not 'HOST "
                                  f"slots=N' (DeepSpeed's form)")
            slots = int(rest[6:])
    return slots


def _named_gpus(flag: str, spec: str) -> list[int] | None:
    """The GPU numbers DeepSpeed's `host[:i,j][@host2...]` names (None: the host's every
    GPU); a host other than this machine is refused (MULTI_NODE)."""
    named: list[int] | None = []
    for entry in spec.split("@"):
        host, _, ids = entry.partition(":")
        if not _is_this_machine(host):
            raise ConfigError(f"{flag} {spec} names {host}: {MULTI_NODE}")
        if not ids:
            named = None
        elif named is not None:
            try:
                named += [int(i) for i in ids.split(",")]
            except ValueError:
                raise ConfigError(f"{flag} {spec}: GPUs are numbers, e.g. localhost:0,2") from None
    return named


def _pick_gpus(flag: str, spec: str, named: list[int] | None, gpu_count: int,
               keep: bool) -> tuple[int, ...]:
    """The GPUs an --include (`keep`) or --exclude of the `named` ones leaves."""
    if not gpu_count:
        raise ConfigError(f"{flag} {spec}: this machine has no GPU; give --num_gpus N for N "
                          f"ranks on the CPU")
    named = list(range(gpu_count)) if named is None else named
    wrong = [i for i in named if not 0 <= i < gpu_count]
    if wrong:
        raise ConfigError(f"{flag} {spec}: this machine has GPUs 0-{gpu_count - 1}, not {wrong[0]}")
    gpus = sorted(set(named)) if keep else [i for i in range(gpu_count) if i not in named]
    if not gpus:
        raise ConfigError(f"{flag} {spec} leaves no GPU to train on")
    return tuple(gpus)


def _gpu_count() -> int:
    """The GPUs torch sees on this machine (CUDA_VISIBLE_DEVICES applied)."""
    import torch  # only where a count decides something: a second or more to import

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host if host not in ("localhost",) else "127.0.0.1", 0))
        return s.getsockname()[1]


# ---- services and processes ------------------------------------------------------------------


def _services(args: argparse.Namespace, loaded: LoadedConfig, job: str,
              stack: contextlib.ExitStack, ranks: str) -> dict:
    """The environment that points the script at the node's services (worker/job.py's
    choice, as the script's own initialize would make it), started if needed."""
    # Here, not at the top: the CLI imports this module to build its parser, and the job's
    # modules import torch (every `tierstack` command, a daemon's start too, would pay it).
    from tierstack.worker.job import SchedulerUse, open_services

    services = open_services(
        stack, loaded.config, job, loaded.keys, tier_manager=args.tier_manager or "",
        tier_manager_setting="--tier-manager",
        scheduler=SchedulerUse.OFF if args.no_scheduler else SchedulerUse.AUTO,
        nvme_paths=[args.nvme_path] if args.nvme_path else None, nvme_setting="--nvme-path")
    env = {TIER_MANAGER_ENV: services.tier_manager}
    if services.scheduler:
        env[SCHEDULER_ENV] = services.scheduler
    print(f"tierstack launch: job {job}, {ranks}, {services.describe()}", file=sys.stderr)
    return env


def _run_ranks(script: Path, script_args: list[str], env: dict, ranks: Ranks) -> int:
    """The script's ranks in child processes; SIGTERM to the launcher is passed on to each.
    The first failing rank's exit code (or 128 + the signal that ended it), after the
    others are stopped; 0 when every rank succeeded."""
    procs = [subprocess.Popen([sys.executable, str(script), *script_args],
                              env={**env, **ranks.environ(rank)}) for rank in range(ranks.count)]

    def pass_on(signum: int, frame) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {s: signal.signal(s, pass_on) for s in (signal.SIGTERM, signal.SIGHUP)}
    # Ctrl-C reaches the ranks through the terminal's process group; the launcher only
    # waits for them to end (a second Ctrl-C too), then cleans up.
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        code = _wait(procs)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 128 - code if code < 0 else code


def _wait(procs: list[subprocess.Popen]) -> int:
    """Wait for every rank; once one fails, the others get SIGTERM (they could only wait
    for it in a collective), then SIGKILL after RANK_STOP_SECONDS. The first failure's code."""
    if len(procs) == 1:
        return procs[0].wait()
    failed: int | None = None
    deadline = None
    while any(p.poll() is None for p in procs):
        if failed is None:
            failed = next((p.returncode for p in procs if p.returncode not in (None, 0)), None)
            if failed is not None:
                deadline = time.monotonic() + RANK_STOP_SECONDS
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
        elif time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.1)
    if failed is None:
        failed = next((p.returncode for p in procs if p.returncode != 0), 0)
    return failed
