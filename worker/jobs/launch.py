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

Every exit path cleans up: the script's exit (its code is the launcher's), Ctrl-C (the
script, in the same process group, gets it itself; the launcher waits for it), SIGTERM to
the launcher (passed on to the script, then waited for), and a launcher killed outright
(the daemons exit with their parent). The daemons are stopped and the job's directories
removed afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from tierstack.addresses import JOB_ENV, SCHEDULER_ENV, TIER_MANAGER_ENV
from tierstack.config import load_config
from tierstack.errors import ConfigError

CONFIG_ENV = "TIERSTACK_CONFIG"
"""The config file `tierstack launch --config` was given, for the script to read."""


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
    parser.add_argument("script", help="the Python training script to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER,
                        help="arguments passed to the script as they are")


def run(args: argparse.Namespace) -> int:
    """Run the script with the services around it; its exit code."""
    script = Path(args.script)
    if not script.is_file():
        raise ConfigError(f"launch: {script} is not a file; give the training script to run "
                          f"(e.g. tierstack launch train.py --epochs 1)")
    config = load_config(args.config)
    job = args.job or f"{script.stem}-{os.getpid()}"
    env = {**os.environ, JOB_ENV: job}
    if args.config:
        env[CONFIG_ENV] = str(Path(args.config).resolve())
    with contextlib.ExitStack() as services:
        env.update(_services(args, config, job, services))
        return _run_script(script, args.script_args, env)


def _services(args: argparse.Namespace, config, job: str, stack: contextlib.ExitStack) -> dict:
    """The environment that points the script at the node's services (worker/job.py's
    choice, as the script's own initialize would make it), started if needed."""
    # Here, not at the top: the CLI imports this module to build its parser, and the job's
    # modules import torch (every `tierstack` command, a daemon's start too, would pay it).
    from tierstack.worker.job import SchedulerUse, open_services

    services = open_services(
        stack, config, job, tier_manager=args.tier_manager or "", tier_manager_setting="--tier-manager",
        scheduler=SchedulerUse.OFF if args.no_scheduler else SchedulerUse.AUTO,
        nvme_paths=[args.nvme_path] if args.nvme_path else None, nvme_setting="--nvme-path")
    env = {TIER_MANAGER_ENV: services.tier_manager}
    if services.scheduler:
        env[SCHEDULER_ENV] = services.scheduler
    print(f"tierstack launch: job {job}, {services.describe()}", file=sys.stderr)
    return env


def _run_script(script: Path, script_args: list[str], env: dict) -> int:
    """The script in a child process; SIGTERM to the launcher is passed on to it. Its exit
    code, or 128 + the signal that ended it."""
    proc = subprocess.Popen([sys.executable, str(script), *script_args], env=env)

    def pass_on(signum: int, frame) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, pass_on) for s in (signal.SIGTERM, signal.SIGHUP)}
    # Ctrl-C reaches the script through the terminal's process group; the launcher only
    # waits for it to end (a second Ctrl-C too), then cleans up.
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        code = proc.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 128 - code if code < 0 else code
