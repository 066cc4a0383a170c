"""torch.distributed set-up for partitioned training, with or without Ray.

Ranks learn their place torchrun-style, from RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR
and MASTER_PORT; the Ray actors (worker/ray_workers.py), `torchrun` and the plain
multiprocessing launcher below all set exactly these, so the partitioned engine runs
the same under each. The backend is NCCL when the rank has a GPU, else gloo.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from tierstack.errors import InvalidArgumentError

# A rank whose peer died waits this long in a collective before failing, instead of forever.
DEFAULT_TIMEOUT = timedelta(minutes=10)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankEnv:
    """Where one rank stands: torchrun's environment variables as plain data."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_environ(cls, environ: dict | None = None) -> "RankEnv":
        env = os.environ if environ is None else environ
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise InvalidArgumentError(
                f"{', '.join(missing)} not set: start ranks with torchrun, tierstack train "
                f"--ranks N, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT")
        return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"])),
                   env["MASTER_ADDR"], int(env["MASTER_PORT"]))

    def to_environ(self) -> dict[str, str]:
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(self.local_rank), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port)}


def rank_device(env: RankEnv, device: str | None = None) -> torch.device:
    """This rank's device: its local GPU when there are GPUs, else the CPU."""
    if device:
        return torch.device(device)
    if torch.cuda.is_available():
        # Ray sets CUDA_VISIBLE_DEVICES to the actor's one GPU; torchrun leaves all visible.
        return torch.device("cuda", env.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_process_group(env: RankEnv | None = None, device: torch.device | None = None,
                       timeout: timedelta = DEFAULT_TIMEOUT) -> RankEnv:
    """Join the job's process group (NCCL on a GPU, gloo on the CPU); returns the rank's env."""
    env = env or RankEnv.from_environ()
    device = device or rank_device(env)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    # env:// rather than tcp://: under torchrun the agent already hosts the rendezvous
    # store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE), and env:// joins it as a client.
    os.environ.update(env.to_environ())
    dist.init_process_group(backend, init_method="env://",
                            rank=env.rank, world_size=env.world_size, timeout=timeout,
                            **({"device_id": device} if device.type == "cuda" else {}))
    # The group may stay joined for the process's life (initialize's engines share it, as
    # DeepSpeed's do). Left to interpreter finalization, gloo's worker threads can still hold
    # tensors whose release needs the GIL then, and the rank dies of SIGABRT ("terminate
    # called without an active exception", pytorch/pytorch#190489) after its work is done.
    atexit.unregister(_leave_process_group)  # once, however often a process joins
    atexit.register(_leave_process_group)
    return env


def _leave_process_group() -> None:
    """At exit: leave the process group while the interpreter is whole (a no-op when the
    job already left it). A failure here is logged, not raised: the rank's work is done."""
    if not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway; say what happened and go on
        log.warning("leaving the process group at exit failed", exc_info=True)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _CallersWorld:
    """The launching process's environment and stdout/stderr as they are at the launch,
    for a rank the fork server starts (which would otherwise have the server's, taken when
    the server started: an earlier call's variables and output files). Pickled into the
    rank's arguments; unpickling in the rank applies them, before the rank runs anything."""

    def __reduce__(self):
        from multiprocessing import reduction

        # DupFd while the rank's process is being started hands it the caller's open files.
        return (_take_callers_world, (dict(os.environ), reduction.DupFd(1), reduction.DupFd(2)))


def _take_callers_world(environ: dict, stdout, stderr) -> None:
    os.environ.clear()
    os.environ.update(environ)
    for fd, given in ((1, stdout), (2, stderr)):
        received = given.detach()
        os.dup2(received, fd)
        os.close(received)


def _run_rank(index: int, fn: Callable, world: int, port: int, args: tuple, _world: None = None) -> None:
    env = RankEnv(index, world, index, "127.0.0.1", port)
    os.environ.update(env.to_environ())
    fn(env, *args)


def _fork_server_preload(fn: Callable) -> None:
    """What the fork server imports once for all the ranks this process launches: torch,
    torch._dynamo (which a model built on the meta device or a Hugging Face model imports:
    3 s of CPU), the job's composition root and the module of the rank function. The
    server is started at the first launch; a module given later is imported by each rank
    itself, as under spawn. None of these starts a thread or touches a GPU at import."""
    import multiprocessing

    modules = ["torch", "torch._dynamo", "torch.distributed", __name__, "tierstack.worker.job"]
    if fn.__module__ != "__main__":
        modules.append(fn.__module__)
    multiprocessing.set_forkserver_preload(modules)


def launch_local(fn: Callable, world: int, *args) -> None:
    """Run `fn(rank_env, *args)` in `world` fresh processes on this machine, without Ray.

    `fn` must be importable (a module-level function). The ranks are forked from
    multiprocessing's fork server, a fresh process that imports torch and `fn`'s module
    once for every launch of this process (a spawned rank imports them itself: seconds of
    CPU per rank), so no thread or CUDA state of the caller leaks into them; each takes the
    caller's environment and stdout/stderr as they are at this call.
    """
    import torch.multiprocessing as mp

    _fork_server_preload(fn)
    context = mp.start_processes(_run_rank, args=(fn, world, free_port(), args, _CallersWorld()),
                                 nprocs=world, join=False, start_method="forkserver")
    try:
        while not context.join():
            pass
    finally:
        # A rank that raised leaves its traceback in a file in the temp directory, which
        # torch reads into the error raised here and never removes.
        for path in context.error_files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
