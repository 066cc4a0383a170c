"""tierstack's typed configuration, and the one place that loads and validates it.

Config is plain dataclasses with defaults. `load_config` accepts a dict, a JSON file
path, or nothing (defaults), rejects unknown keys by their dotted name, and parses
human sizes ("4GiB", "512MB", 1048576).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierstack.config_keys import UserKeys, suggest
from tierstack.deepspeed_config import is_deepspeed_config, refuse_mixed_formats, translate
from tierstack.errors import ConfigError
from tierstack.lr_schedules import LRScheduleConfig
from tierstack.tiers import ACTIVATION_POLICIES, AUTO, NVME, OFFLOAD_DEVICES, BlockTier

if typing.TYPE_CHECKING:
    from tierstack.budgets import Budgets, MachineLimits

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
AUTO_SIZE = "auto"
MAX_SIZE = 1 << 62
"""No size in a config is larger (files, mmap and sqlite take signed 64-bit sizes)."""

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": KiB,
    "m": 1000**2, "mb": 1000**2, "mib": MiB,
    "g": 1000**3, "gb": 1000**3, "gib": GiB,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(value: Any, name: str = "size") -> int:
    """Bytes from an int or a string such as '4GiB', '1.5GB', '4096'."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size in bytes, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if not m or unit not in _SIZE_UNITS:
            raise ConfigError(
                f"{name}: cannot read {value!r} as a size; write bytes (4294967296) "
                f"or a number with a unit (4GiB, 512MiB, 1.5GB)"
            )
        n = int(float(m.group(1)) * _SIZE_UNITS[unit])
    else:
        raise ConfigError(f"{name}: expected a size in bytes, got {value!r}")
    if n < 0:
        raise ConfigError(f"{name}: a size cannot be negative, got {value!r}")
    if n > MAX_SIZE:
        raise ConfigError(f"{name}: {value!r} is more than {MAX_SIZE >> 60} EiB; give a size "
                          f"this machine could hold (e.g. 512GiB)")
    return n


@dataclass
class AioConfig:
    """NVMe IO settings; names and meanings follow DeepSpeed's `aio` section."""

    block_size: int = 1 * MiB
    """Bytes per IO request; a multiple of 4096."""
    queue_depth: int = 8
    """Requests each IO thread keeps in flight."""
    thread_count: int = 1
    """IO submitter threads; thread_count x queue_depth requests are in flight at most (and
    no more than the engine's staging buffers allow: io_engine.STAGING_BYTES)."""
    engine: str = "auto"
    """'native' (the compiled block-IO loop), 'threads' (Python threads), or 'auto'."""

    def validate(self, prefix: str = "aio") -> None:
        if self.engine not in ("auto", "native", "threads"):
            raise ConfigError(f"{prefix}.engine: {self.engine!r} is not one of auto, native, threads")
        if self.block_size < 4096 or self.block_size % 4096:
            raise ConfigError(
                f"{prefix}.block_size: {self.block_size} is not a positive multiple of 4096; "
                f"O_DIRECT needs 4 KiB-aligned requests (1MiB is a good default)"
            )
        for name in ("queue_depth", "thread_count"):
            value = getattr(self, name)
            if not 1 <= value <= 1024:
                raise ConfigError(f"{prefix}.{name}: {value} must be between 1 and 1024")


@dataclass
class CpuPoolConfig:
    """The node's pool of CPU memory: shared-memory arenas that workers map.

    Arenas are created as buffers are needed (a large buffer gets one of its own, small
    ones share arenas, so neither file descriptors nor mappings grow with the tensor
    count: services/tier_manager/cpu_pool.py) and returned to the host when they have
    been empty for `keep_empty_seconds`; nothing is reserved at start."""

    size: int | str = "auto"
    """Cap on the bytes the pool's arenas ever hold; 'auto': the host budget's pool
    share (tierstack/budgets.py: Budgets.cpu_pool), measured when the daemon starts."""
    shm_dir: str = "/dev/shm"
    """Directory of the arena files (a tmpfs)."""
    alignment: int = 4096
    """Every buffer is rounded up to this (O_DIRECT and cudaHostRegister want 4 KiB)."""
    keep_empty_seconds: float = 5.0
    """An arena emptied is kept this long for the next buffer of its size (a worker
    maps and page-locks an arena once, which is slow), then returned to the host. One
    that a new buffer needs room for is returned at once."""

    def validate(self, prefix: str = "cpu_pool") -> None:
        _validate_cap(prefix, self.size, 1)
        if self.alignment < 64 or self.alignment & (self.alignment - 1):
            raise ConfigError(f"{prefix}.alignment must be a power of two >= 64, got {self.alignment}")
        if self.keep_empty_seconds < 0:
            raise ConfigError(f"{prefix}.keep_empty_seconds must be >= 0, got {self.keep_empty_seconds}")


def _validate_grace(prefix: str, seconds: int) -> None:
    """A service's shutdown_grace_seconds: 0 (in-flight calls are cut at once) up to a day."""
    if not 0 <= seconds <= 86400:
        raise ConfigError(f"{prefix}.shutdown_grace_seconds must be between 0 and 86400 (how "
                          f"long calls in flight may finish after SIGTERM), got {seconds}")


def _validate_cap(key: str, value: int | str, at_least: int) -> None:
    """A pool cap: 'auto' or a size of at least `at_least` bytes."""
    if value == AUTO_SIZE:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}.size: expected a size or 'auto', got {value!r}")
    if value < at_least:
        raise ConfigError(f"{key}.size: {value} bytes is less than {at_least}; give a larger "
                          f"size or 'auto'")


@dataclass
class NvmePoolConfig:
    """The node's NVMe pool: one directory per drive, extents striped across them."""

    paths: list[str] = field(default_factory=lambda: [f"/var/tmp/tierstack-{os.getuid()}/nvme"])
    """One directory per drive, each only ours (created 0700; an existing one must be ours
    and writable by nobody else: tierstack/private_paths.py). Per user by default."""
    size: int | str = "auto"
    """Cap on the bytes over all paths (size / len(paths) each); 'auto': the NVMe budget
    (the drives' free space less a margin, measured when the daemon starts). Each path's
    data file grows in chunks as tensors need it and gives back its free tail."""
    aio: AioConfig = field(default_factory=AioConfig)

    def validate(self, prefix: str = "nvme_pool") -> None:
        if not self.paths:
            raise ConfigError(f"{prefix}.paths: give at least one directory")
        if len(set(os.path.realpath(p) for p in self.paths)) != len(self.paths):
            raise ConfigError(f"{prefix}.paths: the same directory is listed twice: {self.paths}")
        self.aio.validate(f"{prefix}.aio")
        _validate_cap(prefix, self.size, self.aio.block_size * len(self.paths))


MAX_HISTORY_SAMPLES = 100_000  # 7 MB of history rows (services/tier_manager/history_ring.py)


@dataclass
class MetricsConfig:
    """The node's metrics: Prometheus /metrics, the HTTP API and the dashboard."""

    enabled: bool = True
    """Collect metrics at all (RPC timings, bandwidth samples, worker reports)."""
    http_listen: str = "127.0.0.1:8470"
    """host:port of the HTTP API, /metrics and dashboard ('' for none). If the port is
    taken, another one is used and logged (GetHttpEndpoint names it)."""
    node_name: str = ""
    """This node's name in metrics and the dashboard; default: the host name."""
    sample_interval_seconds: float = 1.0
    """How often bandwidth and occupancy are sampled for the history."""
    history_seconds: float = 900.0
    """How far back the bandwidth history goes."""
    worker_stale_seconds: float = 30.0
    """A worker that has not reported for this long no longer counts as connected."""
    cluster_nodes: list[str] = field(default_factory=list)
    """HTTP URLs of other nodes the cluster view aggregates with this one (until the
    scheduler supplies its node list)."""
    allowed_hosts: list[str] = field(default_factory=list)
    """Host names the HTTP API answers to besides its own (loopback names, the listen
    host, and beyond loopback the machine's names and addresses): e.g. a DNS alias."""

    @property
    def history_samples(self) -> int:
        """How many samples the history holds."""
        return max(2, int(self.history_seconds / self.sample_interval_seconds) + 1)

    def validate(self, prefix: str = "metrics") -> None:
        for name in ("sample_interval_seconds", "history_seconds", "worker_stale_seconds"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{prefix}.{name} must be positive, got {getattr(self, name)}")
        if self.history_samples > MAX_HISTORY_SAMPLES:
            raise ConfigError(
                f"{prefix}.history_seconds / sample_interval_seconds is {self.history_samples:.3g} "
                f"samples; the daemon keeps at most {MAX_HISTORY_SAMPLES} (their memory is "
                f"reserved at start): shorten the history or sample less often")
        if self.http_listen and not self.http_listen.rpartition(":")[2].isdigit():
            raise ConfigError(f"{prefix}.http_listen: {self.http_listen!r} is not host:port "
                              f"(e.g. 127.0.0.1:8470, 0.0.0.0:0 for any free port)")
        for url in self.cluster_nodes:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"{prefix}.cluster_nodes: {url!r} is not an http(s) URL")


@dataclass
class JobsConfig:
    """Jobs on a node: their state's lifetime and their share of the pools.

    A job is the keys under `<job>/` (a LayerStore's). Its workers open it; when the last
    one closes (or dies), its state is deleted after `grace_seconds` unless it was opened
    with keep (or `tierstack jobs` said keep). After a daemon restart, a job no worker
    opens again within `orphan_seconds` is deleted the same way."""

    default_quota: int = 0
    """Bytes a job's tensors may hold on this node (all tiers counted once) unless it asks
    for another quota when it opens; 0: no quota."""
    grace_seconds: float = 5.0
    """How long a job without workers keeps its state (a worker attaching late, a
    restarted worker re-opening it)."""
    orphan_seconds: float = 600.0
    """After a daemon restart: how long a job's workers have to open it again."""

    def validate(self, prefix: str = "jobs") -> None:
        if isinstance(self.default_quota, bool) or not isinstance(self.default_quota, int) \
                or self.default_quota < 0:
            raise ConfigError(f"{prefix}.default_quota: expected a size (0: none), got "
                              f"{self.default_quota!r}")
        for name in ("grace_seconds", "orphan_seconds"):
            if not 0 <= getattr(self, name) <= 30 * 86400:
                raise ConfigError(f"{prefix}.{name} must be between 0 and 30 days, got "
                                  f"{getattr(self, name)}")


@dataclass
class SecurityConfig:
    """Who may call a service listening on TCP, and how its clients trust it
    (tierstack/rpc.py applies it to gRPC, dashboards/http_api.py to HTTP).

    A unix socket needs neither TLS nor a token: it is 0600 in a 0700 directory of ours,
    so only our user can connect. On a loopback address every local user can connect, so
    every call must carry the token (TLS is used when a certificate is given). Beyond
    loopback, TLS and the token are both required: a server refuses to start without
    them. Empty fields are taken from $TIERSTACK_SECURITY_DIR (token, cert.pem, key.pem,
    ca.pem) when it is set; `tierstack ray-node --make-secrets DIR` writes such a
    directory and `ray up` (deploy/cluster.yaml) deploys it to every node."""

    token_file: str = ""
    """File holding the token (0600). Default: $TIERSTACK_SECURITY_DIR/token, else the
    per-user /tmp/tierstack-<uid>/token, which a server on loopback creates."""
    cert_file: str = ""
    """PEM certificate (chain) a TCP server presents; default $TIERSTACK_SECURITY_DIR/cert.pem."""
    key_file: str = ""
    """PEM private key of cert_file (0600); default $TIERSTACK_SECURITY_DIR/key.pem."""
    ca_file: str = ""
    """PEM certificates a client trusts; default $TIERSTACK_SECURITY_DIR/ca.pem, else cert_file."""
    server_name: str = "tierstack"
    """The name clients check in the server's certificate (nodes share one certificate,
    so it names the cluster, not a host)."""

    def validate(self, prefix: str = "security") -> None:
        if not self.server_name or not self.server_name.isprintable():
            raise ConfigError(f"{prefix}.server_name must be a printable name, got {self.server_name!r}")
        if bool(self.cert_file) != bool(self.key_file):
            raise ConfigError(f"{prefix}: give both cert_file and key_file (TLS needs the pair)")


@dataclass
class TierManagerConfig:
    """Everything one node's tier manager owns."""

    cpu_pool: CpuPoolConfig = field(default_factory=CpuPoolConfig)
    nvme_pool: NvmePoolConfig = field(default_factory=NvmePoolConfig)
    manifest_path: str = ""
    """sqlite manifest of NVMe-resident tensors; default: <first nvme path>/manifest.sqlite."""
    listen: str = ""
    """gRPC address: a unix socket path (unix:/path) or host:port; default: the node's
    socket, $TIERSTACK_TIER_MANAGER or /tmp/tierstack-<uid>/tier-manager.sock."""
    shutdown_grace_seconds: int = 30
    """On SIGTERM, how long in-flight requests (writes) may take to finish."""
    lease_timeout_seconds: float = 600.0
    """A buffer granted by AllocateBuffer and neither committed nor cancelled within this
    time is freed (its worker is presumed dead)."""
    scheduler_address: str = ""
    """The cluster scheduler to register this node with and report bandwidth to
    (unix:/path or host:port); empty: run without a scheduler."""
    node_id: str = ""
    """This node's name at the scheduler; default: the host name."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    jobs: JobsConfig = field(default_factory=JobsConfig)

    def validate(self, prefix: str = "tier_manager") -> None:
        _validate_grace(prefix, self.shutdown_grace_seconds)
        if not 0 < self.lease_timeout_seconds <= 30 * 86400:
            raise ConfigError(f"{prefix}.lease_timeout_seconds must be positive and at most 30 "
                              f"days, got {self.lease_timeout_seconds}")
        if self.node_id and ("/" in self.node_id or not self.node_id.isprintable()):
            raise ConfigError(f"{prefix}.node_id {self.node_id!r}: use printable characters and no '/'")
        self.cpu_pool.validate(f"{prefix}.cpu_pool")
        self.nvme_pool.validate(f"{prefix}.nvme_pool")
        self.metrics.validate(f"{prefix}.metrics")
        self.jobs.validate(f"{prefix}.jobs")

    def resolved_manifest_path(self) -> Path:
        if self.manifest_path:
            return Path(self.manifest_path)
        return Path(self.nvme_pool.paths[0]) / "manifest.sqlite"


def _offload_tier(device: str, max_in_cpu: int) -> BlockTier:
    """The block tier an offload section asks for: DeepSpeed's device names, and 'nvme'
    with max_in_cpu 0 meaning out of the CPU pool between uses."""
    tier = OFFLOAD_DEVICES[device]
    return AUTO if tier == NVME and max_in_cpu != 0 else tier


def _validate_offload(prefix: str, device: str, max_in_cpu: int) -> None:
    if device not in OFFLOAD_DEVICES:
        raise ConfigError(f"{prefix}.device: {device!r} is not one of {', '.join(OFFLOAD_DEVICES)}")
    if max_in_cpu < 0:
        raise ConfigError(f"{prefix}.max_in_cpu must be >= 0, got {max_in_cpu}")


WEIGHTS_FROM_MASTERS = ("auto", "on", "off")
"""train.params.weights_from_masters' values."""


@dataclass
class ParamOffloadConfig:
    """Where the blocks' parameters live beyond the device (DeepSpeed's offload_param).

    A block's tier is its `train.tier_overrides` pattern if one applies, else this
    section's. DeepSpeed's `pin_memory` is not here: the CPU pool is always page-locked.
    """

    device: str = "auto"
    """'auto' (the budgets decide: blocks that fit stay on the device, the rest are
    offloaded), 'none' (blocks stay on the device and train there), 'cpu' (kept in the
    CPU pool, never evicted) or 'nvme' (in the NVMe pool; see max_in_cpu)."""
    buffer_count: int = 5
    """Blocks on the device at once while training: the one in use and buffer_count - 1
    (at least 1) prefetched ahead of it. This is the starting prefetch depth (and NVMe
    read-ahead); a scheduler plan replaces it. The device budget bounds the bytes either way."""
    buffer_size: int = 0
    """Elements per staging buffer, as in DeepSpeed: when set (a DeepSpeed JSON sets it)
    with device 'cpu' or 'nvme', an offloaded block holding a tensor of more elements than
    this is an error naming the block, the tensor and both numbers (checked when the engine
    registers its blocks). 0, the default: no limit. tierstack stages whole blocks within
    the device budget, so nothing of its own needs a cap; DeepSpeed's default of 1e8 would
    refuse any model whose hidden size is past about 5,800 (a 3 x 6144 x 6144 QKV)."""
    max_in_cpu: int = 1_000_000_000
    """With device 'nvme', as DeepSpeed's: the parameter elements the CPU pool keeps cached
    between uses, counted over the blocks in order (blocks a tier override places are not
    counted). The blocks past it leave the pool after each use (evicted before anything
    else); 0 sends them all out. The pool itself is shared by the node's jobs and bounded by
    tier_manager.cpu_pool.size."""
    weights_from_masters: str = "auto"
    """With precision bf16 or fp16: 'on' keeps no low-precision copy of an offloaded
    block's weights in host memory (12 instead of 14 bytes per parameter there: fp32
    master and two moments): each load copies the fp32 masters to the device and rounds
    them there (to nearest even, as torch's .to() does), twice the bytes over PCIe per
    load, and the tier manager's AdamW writes no low-precision weights. 'off' keeps the
    copy. 'auto': 'on' only where the offloaded blocks' host state at 14 bytes per
    parameter does not fit the CPU pool and at 12 it does (a model that fits keeps the
    faster loads). Partitioned (multi-rank) jobs refuse 'on' and 'auto' stays off there
    (docs/architecture/design-notes.md)."""

    def tier(self) -> BlockTier:
        """The tier of a block with no override: 'gpu', 'cpu', 'nvme' or 'auto'."""
        return _offload_tier(self.device, self.max_in_cpu)

    def validate(self, prefix: str) -> None:
        _validate_offload(prefix, self.device, self.max_in_cpu)
        if self.weights_from_masters not in WEIGHTS_FROM_MASTERS:
            raise ConfigError(f"{prefix}.weights_from_masters: {self.weights_from_masters!r} is "
                              f"not one of {', '.join(WEIGHTS_FROM_MASTERS)}")
        if self.buffer_count < 1:
            raise ConfigError(f"{prefix}.buffer_count must be at least 1, got {self.buffer_count}")
        if self.buffer_size < 0:
            raise ConfigError(f"{prefix}.buffer_size must be 0 (no limit) or positive, "
                              f"got {self.buffer_size}")


@dataclass
class OptimizerOffloadConfig:
    """Where offloaded blocks' optimizer state lives (DeepSpeed's offload_optimizer).

    An offloaded block's AdamW runs in the tier manager over state kept there (moments,
    fp32 masters, gradients), so this section places that state; a block on the device
    keeps its state on the device whatever it says (offloading the optimizer state of
    blocks that stay on the device is not supported: the engine logs a warning).
    DeepSpeed's `buffer_count` and `pin_memory` are not here: the tier manager pipelines
    the AdamW step two blocks at a time, and the CPU pool is always page-locked.
    """

    device: str = "none"
    """'cpu' (kept in the CPU pool, never evicted), 'nvme' (see max_in_cpu), or 'none':
    as DeepSpeed's default, nothing asked, so an offloaded block's state goes where its
    parameters go."""
    max_in_cpu: int = 1_000_000_000
    """With device 'nvme': 0 sends the state out of the CPU pool between steps; any other
    value lets the CPU pool keep what fits (as for params.max_in_cpu; not a quota)."""

    def tier(self) -> BlockTier:
        """The tier of an offloaded block's state with no override ('gpu' for 'none':
        the engine puts it with the block's parameters)."""
        return _offload_tier(self.device, self.max_in_cpu)

    def validate(self, prefix: str) -> None:
        _validate_offload(prefix, self.device, self.max_in_cpu)


@dataclass
class OptimizerConfig:
    """AdamW with fp32 master weights, run by the tier manager where the bytes are."""

    type: str = "adamw"
    """'adamw', the one optimizer; 'adam' is accepted as DeepSpeed means it (AdamW unless
    adam_w_mode is false, which the DeepSpeed loader refuses)."""
    lr: float = 1e-3
    """The learning rate (a schedule, train.lr_schedule, moves it from step to step)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW's (beta1, beta2): the decay rates of the gradient's moving averages."""
    eps: float = 1e-8
    """Added to the second moment's square root (numerical safety)."""
    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW's), per step, scaled by the learning rate."""

    def validate(self, prefix: str) -> None:
        if self.type.lower() not in ("adamw", "adam"):
            raise ConfigError(f"{prefix}.type: {self.type!r} is not supported; use AdamW")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"{prefix}.betas must be two numbers in [0, 1), got {self.betas}")
        if self.lr <= 0 or self.eps <= 0 or self.weight_decay < 0:
            raise ConfigError(f"{prefix}: lr and eps must be positive and weight_decay >= 0")


@dataclass
class ActivationConfig:
    """What each offloaded block keeps for its backward (DeepSpeed's activation_checkpointing).

    Blocks made resident by the placement follow the placement (kept or recomputed on the
    device); this section speaks for the blocks that stay offloaded.
    """

    policy: str = "auto"
    """'auto' (the HBM budget decides: blocks keep their activations where they fit, are
    recomputed from their input otherwise, and their inputs go to the tier manager when
    even those do not fit), 'keep' (every block keeps its activations: no recompute),
    'recompute' (only each block's input stays on the device), 'cpu' or 'nvme' (each
    block's input goes to the tier manager's CPU pool or NVMe during the forward, comes
    back in reverse order for the backward, and is deleted once that block's backward is
    done; never durable)."""
    partition: bool = False
    """Partitioned (data-parallel) jobs: spread the block inputs that go to the tier
    manager (policy 'cpu', 'nvme', or 'auto' where the placement sends them there) over
    the ranks' tier managers, each node holding a share proportional to its pool, instead
    of each rank's inputs all on its own node (DeepSpeed's partition_activations; see
    worker/engine/partitioned_stash.py). One rank keeps them whole."""

    def validate(self, prefix: str) -> None:
        if self.policy not in ACTIVATION_POLICIES:
            raise ConfigError(f"{prefix}.policy: {self.policy!r} is not one of "
                              f"{', '.join(ACTIVATION_POLICIES)}")
        if not isinstance(self.partition, bool):
            raise ConfigError(f"{prefix}.partition: expected true or false, got {self.partition!r}")
        if self.partition and self.policy in ("keep", "recompute"):
            raise ConfigError(
                f"{prefix}.partition spreads the block inputs kept by the tier managers over "
                f"the ranks' nodes, and {prefix}.policy {self.policy!r} keeps them on each "
                f"rank's device, where data-parallel ranks hold different inputs (each device "
                f"keeping 1/N of every rank's would hold as many bytes); set policy to 'cpu', "
                f"'nvme' or 'auto', or partition to false")


@dataclass
class LossScaleConfig:
    """fp16 loss scaling (DeepSpeed's `fp16` section), used when train.precision is 'fp16'
    (worker/engine/loss_scaler.py). A step whose gradients overflow is skipped; with dynamic
    scaling the scale then halves, and doubles again after loss_scale_window clean steps."""

    loss_scale: float = 0.0
    """0: dynamic scaling; any other value: this static scale."""
    initial_scale_power: int = 16
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """Steps without an overflow before the dynamic scale doubles."""
    hysteresis: int = 2
    """Overflows that only skip their step before one halves the scale: the hysteresis-th
    overflow since the start or the last rise halves it, and so does every one after it
    until the scale rises again."""
    consecutive_hysteresis: bool = False
    """Count those overflows in a row only: every clean step refills the hysteresis."""
    min_loss_scale: float = 1.0
    """The dynamic scale never goes below this; an overflow at it stops training."""

    def validate(self, prefix: str) -> None:
        if not 0 <= self.loss_scale < math.inf:
            raise ConfigError(f"{prefix}.loss_scale must be 0 (dynamic) or a positive static "
                              f"scale, got {self.loss_scale}")
        if not 0 <= self.initial_scale_power <= 64:
            raise ConfigError(f"{prefix}.initial_scale_power must be between 0 and 64 (the "
                              f"scale starts at 2**power; 16 is DeepSpeed's default), got "
                              f"{self.initial_scale_power}")
        for name in ("loss_scale_window", "hysteresis"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{prefix}.{name} must be at least 1, got {getattr(self, name)}")
        if not 0 < self.min_loss_scale < math.inf:
            raise ConfigError(f"{prefix}.min_loss_scale must be positive, got {self.min_loss_scale}")
        if self.loss_scale == 0 and self.min_loss_scale > 2 ** self.initial_scale_power:
            raise ConfigError(
                f"{prefix}.min_loss_scale {self.min_loss_scale} is above the initial scale "
                f"2**{self.initial_scale_power}; lower it or raise {prefix}.initial_scale_power")


@dataclass
class TensorBoardConfig:
    """TensorBoard event files of the job's figures (DeepSpeed's `tensorboard` section), written
    through torch.utils.tensorboard's SummaryWriter, which needs the tensorboard package."""

    enabled: bool = False
    """Write the event files (rank 0; without tensorboard installed, one line says so)."""
    output_path: str = ""
    """The files go to output_path/job_name ('' : job_name under the working directory)."""
    job_name: str = "DeepSpeedJobName"
    """The run's directory under output_path."""


@dataclass
class CsvMonitorConfig:
    """One CSV file per figure (DeepSpeed's `csv_monitor` section): output_path/job_name/
    Train_Samples_train_loss.csv and so on, each a `step,<figure>` header then a row per step."""

    enabled: bool = False
    """Write the files (rank 0)."""
    output_path: str = ""
    """The files go to output_path/job_name ('' : job_name under the working directory)."""
    job_name: str = "DeepSpeedJobName"
    """The run's directory under output_path."""


@dataclass
class WandbConfig:
    """Weights & Biases (DeepSpeed's `wandb` section): the job's figures go to wandb.log, where
    the wandb package is installed (otherwise one line says so and training goes on)."""

    enabled: bool = False
    """Log the figures (rank 0)."""
    group: str = ""
    """The run's group ('' : none)."""
    team: str = ""
    """The entity the run belongs to ('' : wandb's default)."""
    project: str = "deepspeed"
    """The wandb project."""


@dataclass
class MonitorConfig:
    """What an engine from tierstack.initialize prints and records of its steps, as DeepSpeed's
    (worker/api/step_report.py): step lines, phase timers, and the figures (loss, learning
    rate, loss scale, phase times) for TensorBoard, CSV files and wandb, under DeepSpeed's
    event names (Train/Samples/train_loss, Train/Samples/lr, ...). The node's dashboard and
    Prometheus get the same figures whatever this says."""

    steps_per_print: int = 0
    """Every this many optimizer steps, the step line ('[Rank 0] step=N, skipped=S, lr=[...],
    mom=[...]') and the throughput line (samples/s, memory); 0: none."""
    wall_clock_breakdown: bool = False
    """Time each micro step's forward, backward and optimizer step and print them ('time (ms)
    | fwd_microstep: ...'), and each optimizer step's sums ('time (ms) | fwd: ...')."""
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    csv_monitor: CsvMonitorConfig = field(default_factory=CsvMonitorConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def validate(self, prefix: str) -> None:
        if self.steps_per_print < 0:
            raise ConfigError(f"{prefix}.steps_per_print must be 0 (no step lines) or a number of "
                              f"steps, got {self.steps_per_print}")

    @property
    def writes_events(self) -> bool:
        """Whether any monitor records the figures (DeepSpeed's monitor.enabled)."""
        return self.tensorboard.enabled or self.csv_monitor.enabled or self.wandb.enabled


DEVICE_BUDGET_LAYERS = 3
"""The device budget, in offloaded layers' worth, when none is given."""


@dataclass
class TrainConfig:
    """How a job trains: batch, precision, where each kind of state lives."""

    micro_batch_size: int = 8
    """Rows per forward/backward. `tierstack train` trains on batches of
    micro_batch_size x gradient_accumulation_steps rows unless --batch-size is given."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step: the engine's train_step splits each batch's rows
    into this many equal parts, accumulates their gradients and steps once."""
    precision: str = "fp32"
    """'fp32' end to end, or 'bf16' or 'fp16' on the device with fp32 masters ('fp16' with
    loss scaling: train.fp16)."""
    gradient_clipping: float = 0.0
    """Clip the global gradient norm to this (0: no clipping)."""
    device_budget: int = 0
    """Device bytes that offloaded layers may hold at once; 0: three layers' worth
    (DEVICE_BUDGET_LAYERS). `tierstack train --device-budget` overrides it."""
    params: ParamOffloadConfig = field(default_factory=ParamOffloadConfig)
    optimizer_state: OptimizerOffloadConfig = field(default_factory=OptimizerOffloadConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    activations: ActivationConfig = field(default_factory=ActivationConfig)
    tier_overrides: dict[str, str] = field(default_factory=dict)
    """Module name pattern -> tier ('gpu', 'cpu', 'nvme') of all that module's state,
    parameters and optimizer state alike, e.g. "model.layers[3-]": "nvme"."""
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    fp16: LossScaleConfig = field(default_factory=LossScaleConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)

    def device_budget_bytes(self, layer_bytes: int) -> int:
        """The device budget in bytes, for a model whose offloaded layers are `layer_bytes`."""
        return self.device_budget or DEVICE_BUDGET_LAYERS * layer_bytes

    def validate(self, prefix: str = "train") -> None:
        for name in ("micro_batch_size", "gradient_accumulation_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{prefix}.{name} must be at least 1, got {getattr(self, name)}")
        if self.precision not in ("bf16", "fp16", "fp32"):
            raise ConfigError(f"{prefix}.precision: {self.precision!r} is not one of bf16, fp16, fp32")
        if self.gradient_clipping < 0:
            raise ConfigError(f"{prefix}.gradient_clipping must be >= 0")
        self.params.validate(f"{prefix}.params")
        if self.params.weights_from_masters == "on" and self.precision == "fp32":
            raise ConfigError(f"{prefix}.params.weights_from_masters 'on' needs {prefix}.precision "
                              f"bf16 or fp16 (fp32 weights are their own masters); set it to "
                              f"'auto' or 'off'")
        self.optimizer_state.validate(f"{prefix}.optimizer_state")
        self.optimizer.validate(f"{prefix}.optimizer")
        self.activations.validate(f"{prefix}.activations")
        self.lr_schedule.validate(f"{prefix}.lr_schedule")
        self.fp16.validate(f"{prefix}.fp16")
        self.monitor.validate(f"{prefix}.monitor")
        from tierstack.module_tiers import ModuleTiers
        ModuleTiers(self.tier_overrides, f"{prefix}.tier_overrides")  # checks every pattern


@dataclass
class SchedulerConfig:
    """The cluster scheduler: where it listens and when it re-plans."""

    listen: str = ""
    """gRPC address: unix:/path or host:port; default: $TIERSTACK_SCHEDULER or
    /tmp/tierstack-<uid>/scheduler.sock."""
    report_interval_seconds: float = 2.0
    """How often tier managers report measured bandwidth."""
    replan_threshold: float = 0.25
    """A link whose measured bandwidth is off a plan's assumption by more than this
    fraction (either way) counts as drifting."""
    replan_after_seconds: float = 10.0
    """Re-plan once a link has drifted for this long without a report back in range."""
    shutdown_grace_seconds: int = 5
    """On SIGTERM, how long in-flight requests may take to finish."""
    metrics_listen: str = "127.0.0.1:8471"
    """host:port of the scheduler's HTTP API: its /metrics, the cluster view over every
    registered node's API, and the dashboard ('' for none; a taken port: any free one)."""
    metrics_allowed_hosts: list[str] = field(default_factory=list)
    """Host names its HTTP API answers to besides its own (as metrics.allowed_hosts)."""

    def validate(self, prefix: str = "scheduler") -> None:
        _validate_grace(prefix, self.shutdown_grace_seconds)
        for name in ("report_interval_seconds", "replan_threshold", "replan_after_seconds"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{prefix}.{name} must be positive, got {getattr(self, name)}")
        if self.replan_threshold >= 1:
            raise ConfigError(f"{prefix}.replan_threshold is a fraction (0.25 = 25%); "
                              f"got {self.replan_threshold}")


@dataclass
class BudgetsConfig:
    """A job's budgets (tierstack/budgets.py): bytes, or "auto" to take the machine's
    default (its capacity less a margin, measured when the job starts)."""

    hbm: int | str = AUTO_SIZE
    """Device memory for training state, per device."""
    host: int | str = AUTO_SIZE
    """Host RAM for the tier manager's CPU pool and our processes' own memory."""
    nvme: int | str = AUTO_SIZE
    """Bytes on the NVMe pool's drives."""

    def validate(self, prefix: str = "budgets") -> None:
        for name in ("hbm", "host", "nvme"):
            value = getattr(self, name)
            if value != AUTO_SIZE and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"{prefix}.{name}: expected a size or 'auto', got {value!r}")

    def resolve(self, limits: "MachineLimits") -> "Budgets":
        """The budgets in bytes: stated ones checked against the machine, 'auto' ones
        its defaults."""
        from tierstack.budgets import Budgets, default_budgets

        defaults = default_budgets(limits)
        names = ("hbm", "host", "nvme")
        budgets = Budgets(**{name: getattr(defaults, name) if getattr(self, name) == AUTO_SIZE
                             else getattr(self, name) for name in names},
                          stated=frozenset(n for n in names if getattr(self, n) != AUTO_SIZE))
        limits.check(budgets)
        return budgets


@dataclass
class TierstackConfig:
    """The root of a tierstack config file."""

    tier_manager: TierManagerConfig = field(default_factory=TierManagerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    budgets: BudgetsConfig = field(default_factory=BudgetsConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def validate(self) -> None:
        self.budgets.validate("budgets")
        self.security.validate("security")
        self.tier_manager.validate("tier_manager")
        self.train.validate("train")
        self.scheduler.validate("scheduler")
        uses_nvme = NVME in (self.train.params.device, self.train.optimizer_state.device)
        uses_nvme = uses_nvme or NVME in self.train.tier_overrides.values()
        if uses_nvme and not self.tier_manager.nvme_pool.paths:
            raise ConfigError("train offloads to nvme but tier_manager.nvme_pool.paths is empty")


_SIZE_FIELDS = {"size", "block_size", "alignment", "device_budget", "default_quota"}


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"unknown config key {where}{unknown[0]}; "
                          f"{suggest(str(unknown[0]), names, where)}")
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, key)
        elif hint == int | str:  # a size, or "auto"
            kwargs[name] = value if value == AUTO_SIZE else parse_size(value, key)
        elif name in _SIZE_FIELDS:
            kwargs[name] = parse_size(value, key)
        elif hint is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{key}: expected an integer, got {value!r}")
            kwargs[name] = value
        elif hint is str:
            if not isinstance(value, str):
                raise ConfigError(f"{key}: expected a string, got {value!r}")
            kwargs[name] = value
        elif hint is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{key}: expected a number, got {value!r}")
            kwargs[name] = float(value)
        elif hint is bool:
            if not isinstance(value, bool):
                raise ConfigError(f"{key}: expected true or false, got {value!r}")
            kwargs[name] = value
        elif hint == list[str]:
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{key}: expected a list of strings, got {value!r}")
            kwargs[name] = list(value)
        elif hint == list[float]:
            if not isinstance(value, list) or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
                raise ConfigError(f"{key}: expected a list of numbers, got {value!r}")
            kwargs[name] = [float(v) for v in value]
        elif hint == dict[str, str]:
            if not isinstance(value, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
                raise ConfigError(f"{key}: expected an object of strings, got {value!r}")
            kwargs[name] = dict(value)
        elif hint == dict[str, Any]:  # checked by its section (a schedule's params)
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                raise ConfigError(f"{key}: expected an object, got {value!r}")
            kwargs[name] = copy.deepcopy(value)
        else:  # pragma: no cover - a field type this loader was not taught
            raise TypeError(f"config loader cannot read field {key} of type {hint}")
    return cls(**kwargs)


def apply_budgets(config: TierstackConfig) -> None:
    """Stated host / NVMe budgets size the tier manager's pools where those say 'auto':
    the CPU pool gets the host budget's pool share, the NVMe pool the NVMe budget. (With
    both 'auto', the daemon measures its machine when it starts.)"""
    from tierstack.budgets import HOST_OVERHEAD, pool_share

    tm, budgets = config.tier_manager, config.budgets
    if budgets.host != AUTO_SIZE and tm.cpu_pool.size == AUTO_SIZE:
        if pool_share(budgets.host) <= 0:
            raise ConfigError(
                f"budgets.host is {budgets.host} bytes, no more than the {HOST_OVERHEAD} bytes "
                f"our processes need besides the CPU pool; raise budgets.host")
        tm.cpu_pool.size = pool_share(budgets.host)
    if budgets.nvme != AUTO_SIZE and tm.nvme_pool.size == AUTO_SIZE:
        tm.nvme_pool.size = budgets.nvme


def load_config(source: dict | str | os.PathLike | None = None,
                world_size: int | None = None) -> TierstackConfig:
    """Load, validate and return the config from a dict, a JSON file, or defaults.

    A DeepSpeed config (one with a `zero_optimization` section, or any key only DeepSpeed
    has: stage 0) is accepted as is and translated (tierstack/deepspeed_config.py); anything
    else is tierstack's own format. `world_size`: the job's data-parallel ranks, which a
    DeepSpeed train_batch_size counts (default: WORLD_SIZE, as each rank of torchrun or
    tierstack launch has it).
    """
    return load_config_with_keys(source, world_size).config


@dataclass(frozen=True)
class LoadedConfig:
    """A config as `load_config_with_keys` loaded it, and the keys its user wrote."""

    config: TierstackConfig
    keys: UserKeys
    """The user's key behind each translated one (a DeepSpeed JSON's); empty for tierstack's
    own format. A door names settings with it in the errors it raises later (a directory
    that cannot be made, a block too large for offload_param.buffer_size)."""


def config_source(source: Any, who: str) -> dict:
    """A config as a dict: given as one, or read from a JSON file's path; `who` takes it
    (for the error when it is neither)."""
    if isinstance(source, dict):
        return source
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file {path} is not valid JSON: {e}") from None
    raise ConfigError(f"{who} takes a JSON file's path or a dict, got {type(source).__name__}")


def load_config_with_keys(source: dict | str | os.PathLike | None = None,
                          world_size: int | None = None) -> LoadedConfig:
    """`load_config`, with the user's keys for the errors that come after loading."""
    data = config_source({} if source is None else source, "the config")
    if not is_deepspeed_config(data):
        return LoadedConfig(_load(data), UserKeys())
    refuse_mixed_formats(data, tuple(f.name for f in dataclasses.fields(TierstackConfig)))
    translation = translate(data, world_size)  # its own errors name the user's keys already
    try:
        return LoadedConfig(_load(translation.config), translation.keys)
    except ConfigError as e:  # a translated key named as the user wrote it
        raise translation.keys.rename(e) from None


def _load(data: dict) -> TierstackConfig:
    """A tierstack config dict built, validated and its budgets applied."""
    config = _build(TierstackConfig, data, "")
    config.validate()
    apply_budgets(config)
    config.tier_manager.validate("tier_manager")
    return config


def config_dict(config: Any) -> dict:
    """A config dataclass as the plain dict `load_config` reads back (every field)."""
    return dataclasses.asdict(config)


def section(config_cls: type, data: dict | None, prefix: str) -> Any:
    """Build and validate one config section (e.g. a pool's) from a dict."""
    obj = _build(config_cls, data or {}, prefix)
    obj.validate(prefix)
    return obj
