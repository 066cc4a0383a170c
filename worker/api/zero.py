"""`tierstack.zero`: DeepSpeed's `zero.Init` and `zero.GatheredParameters`, over the tiers.

    with tierstack.zero.Init(config_dict_or_path=ds_config):
        model = MyModel()                       # never whole in host memory
    engine, *_ = tierstack.initialize(model=model, config=ds_config)

    with tierstack.zero.GatheredParameters(list(model.blocks[0].parameters()), modifier_rank=0):
        model.blocks[0].fc.weight.zero_()     # reaches the tiers' weights and fp32 masters

**Init.** Inside the context, each parameter a module registers is kept in host memory
only while it is recent: past `host_bytes` of live parameters, the least recently used
ones are written to a spill file (the job's directory under the config's NVMe path,
removed with the run) and parked (worker/engine/block_views.py: shape, dtype and name
stay, the bytes go). A parked parameter whose values a model's own code uses — its
`reset_parameters`, a Hugging Face `post_init`, an `apply(init_fn)` — is brought back in
on that use, so every init runs unchanged, in its order, with the RNG's numbers a plain
construction would draw: same seed, same weights. Host memory while a model is built is
`host_bytes` plus the largest single parameter, whatever the model's size.
`tierstack.initialize` then takes each block's tensors from the spill just before the
block is stored in the tiers (one block in host memory at a time), then the rest.

DeepSpeed's arguments: `remote_device` "cpu" keeps the parked bytes in host memory
(compact, no file), "nvme" or None spills to disk; `dtype` casts each parameter as it is
registered, as DeepSpeed does; `config_dict_or_path` names the NVMe path; `pin_memory`,
`mem_efficient_linear`, `data_parallel_group`, `mpu` and `sequence_data_parallel_group`
are DeepSpeed's buffers and groups, which tierstack decides itself (accepted, said once at
INFO); `enabled=False` makes it a no-op.

**GatheredParameters.** Brings the given parameters in for the `with` block (every
parameter of each offloaded block named, read from the tiers once its update is done);
with `modifier_rank` (the rank whose changes count; any rank on one process), what the
body changed is written back at the end — an offloaded block's weights and fp32 masters,
a persistent parameter's master — so that training goes on from it. With
`modifier_rank=None` the values are read-only.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import math
import os
import threading
import uuid
import weakref
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist

from tierstack.errors import InvalidArgumentError
from tierstack.worker.engine.block_views import is_parked, owner_of, park, unpark
from tierstack.worker.node.run_directory import job_directories

log = logging.getLogger(__name__)

__all__ = ["GatheredParameters", "Init", "register_external_parameter", "materialize_spilled"]

HOST_BYTES = 256 << 20
"""Bytes of recently registered parameters zero.Init keeps in host memory while a model is built."""

_active: list["_Spill"] = []  # the Init contexts entered, innermost last
_patch_lock = threading.Lock()
_original_register = torch.nn.Module.register_parameter


def _register_parameter(module: torch.nn.Module, name: str, param) -> None:
    """torch.nn.Module.register_parameter inside zero.Init: the parameter joins the spill."""
    spill = _active[-1] if _active else None
    if spill is not None and param is not None and not is_parked(param):
        param = spill.adopt(param)
    _original_register(module, name, param)


class _Spill:
    """The parked bytes of one zero.Init's parameters: a file (or host memory), an LRU of
    the parameters in memory, and a run directory removed with the run."""

    gathers_on_use = True  # a model's own init code runs on a parked parameter unchanged

    def __init__(self, host_bytes: int, directory_bases: list[str] | None, dtype: torch.dtype | None) -> None:
        self.host_bytes = host_bytes
        self.dtype = dtype
        self._live: collections.OrderedDict[int, torch.nn.Parameter] = collections.OrderedDict()
        self._live_bytes = 0
        self._where: dict[int, tuple[int, torch.Size, torch.dtype, str]] = {}  # id -> offset, ...
        self._memory: dict[int, torch.Tensor] = {}  # remote_device "cpu": bytes kept here
        self._names = 0
        self._lock = threading.RLock()
        self._stack = contextlib.ExitStack()
        self._fd: int | None = None
        self._end = 0
        self._parked_since_trim = 0
        if directory_bases is not None:
            (directory,) = self._stack.enter_context(job_directories(
                directory_bases[:1], f"zero-init-{os.getpid()}-{uuid.uuid4().hex[:6]}",
                "zero.Init's NVMe path (zero_optimization.offload_param.nvme_path)"))
            path = Path(directory) / "parameters.spill"
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            self._stack.callback(os.close, self._fd)
        # Removed with the process at the latest (the engine takes every block's bytes at
        # initialize; a model never trained keeps its file until then).
        self._closer = weakref.finalize(self, self._stack.close)

    # ---- parameters coming and going -------------------------------------------------------

    def adopt(self, param: torch.nn.Parameter) -> torch.nn.Parameter:
        """A parameter registered inside Init: cast as asked, kept live (the LRU may park
        older ones)."""
        if self.dtype is not None and param.is_floating_point() and param.dtype != self.dtype:
            param.data = param.data.to(self.dtype)
        param._tierstack_owner = self
        param._tierstack_spill_name = f"parameter {self._names}"
        self._names += 1
        self._touch(param)
        return param

    def _touch(self, param: torch.nn.Parameter) -> None:
        with self._lock:
            key = id(param)
            if key in self._live:
                self._live.move_to_end(key)
                return
            self._live[key] = param
            self._live_bytes += param.numel() * param.element_size()
            while self._live_bytes > self.host_bytes and len(self._live) > 1:
                _, oldest = self._live.popitem(last=False)
                nbytes = oldest.numel() * oldest.element_size()
                self._live_bytes -= nbytes
                self._park(oldest)
                self._parked_since_trim += nbytes
            if self._parked_since_trim > self.host_bytes // 4:
                # glibc keeps what the parked tensors freed for its heap: give it back, or
                # the process grows with the model after all (9 MB of 25 parked, measured).
                _malloc_trim()
                # The spill's dirty pages are host memory too until written: write them
                # and drop them from the page cache (MemAvailable grew 1.46 GB over a
                # 2.7 GB model's construction without this).
                if self._fd is not None:
                    os.fdatasync(self._fd)
                    os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
                self._parked_since_trim = 0

    def _park(self, param: torch.nn.Parameter) -> None:
        """Write `param`'s bytes away and leave its metadata (block_views.park)."""
        data = param.detach().contiguous()
        nbytes = data.numel() * data.element_size()
        key = id(param)
        if self._fd is None:
            self._memory[key] = data.clone()
            offset = 0
        else:
            offset, _, _, _ = self._where.get(key, (None, None, None, None))
            if offset is None or self._where[key][1] != data.shape:
                offset, self._end = self._end, self._end + nbytes
            if nbytes:
                os.pwrite(self._fd, _buffer(data.cpu()), offset)
        self._where[key] = (offset, data.shape, data.dtype, str(data.device))
        park(param, getattr(param, "_tierstack_spill_name", "parameter"), data.shape, self,
             torch.empty(0, dtype=data.dtype, device=data.device))

    def _load(self, param: torch.nn.Parameter) -> torch.Tensor:
        offset, shape, dtype, device = self._where[id(param)]
        if self._fd is None:
            return self._memory.pop(id(param))
        nbytes = math.prod(shape) * dtype.itemsize
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            got = os.preadv(self._fd, [_buffer(buf)], offset)
            if got != nbytes:
                raise InvalidArgumentError(f"zero.Init's spill file is short ({got} of {nbytes} "
                                           f"bytes at {offset}): was it removed?")
        return buf.view(dtype).reshape(shape).to(device)

    # ---- ParameterOwner (block_views) ------------------------------------------------------

    def gather(self, params: list[torch.nn.Parameter]) -> None:
        with self._lock:
            for param in params:
                if is_parked(param):
                    unpark(param, self._load(param))
                    self._touch(param)

    def release(self, params: list[torch.nn.Parameter], modified: bool) -> None:
        """Back to the LRU: parked again once newer parameters push it out (its values as
        they are then, changed or not)."""

    def take(self, param: torch.nn.Parameter) -> None:
        """`param` in memory for good, no longer the spill's (the engine stores it now)."""
        with self._lock:
            if is_parked(param):
                unpark(param, self._load(param))
            key = id(param)
            if self._live.pop(key, None) is not None:
                self._live_bytes -= param.numel() * param.element_size()
            self._where.pop(key, None)
            del param._tierstack_owner
            if not self._where and not self._live:
                self._closer()  # every parameter taken: the spill file and its run go


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: its allocator returns memory its own way


def _buffer(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes as a writable buffer, no copy (and no numpy)."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class Init:
    """DeepSpeed's zero.Init: models built inside never sit whole in host memory (module doc)."""

    def __init__(self, module: torch.nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: str | None = None,
                 pin_memory: bool = False, config_dict_or_path: Any = None, config: Any = None,
                 enabled: bool = True, dtype: torch.dtype | None = None, mpu: Any = None,
                 sequence_data_parallel_group: Any = None, param_swapper: Any = None,
                 host_bytes: int = HOST_BYTES, **kwargs) -> None:
        if module is not None:
            raise InvalidArgumentError(
                "zero.Init(module=...) converts a model built already; tierstack's initialize "
                "takes a built model as it is: pass it to tierstack.initialize instead")
        if kwargs:
            raise InvalidArgumentError(f"zero.Init does not take {sorted(kwargs)}; its arguments "
                                       f"are DeepSpeed's (see worker/api/zero.py)")
        if remote_device not in (None, "cpu", "nvme"):
            raise InvalidArgumentError(f"zero.Init(remote_device={remote_device!r}): give None, "
                                       f"'cpu' or 'nvme'")
        if host_bytes <= 0:
            raise InvalidArgumentError(f"zero.Init(host_bytes={host_bytes}) must be positive")
        self.enabled = enabled
        self.remote_device = remote_device
        self.dtype = dtype
        self.host_bytes = host_bytes
        self.config = config_dict_or_path if config_dict_or_path is not None else config
        decided = [name for name, value in (("pin_memory", pin_memory), ("mpu", mpu),
                                             ("data_parallel_group", data_parallel_group),
                                             ("sequence_data_parallel_group", sequence_data_parallel_group),
                                             ("param_swapper", param_swapper)) if value]
        if decided:
            log.info("zero.Init: %s are DeepSpeed's buffers and groups; tierstack decides them "
                     "(the tier manager pins its pool, ranks are the job's)", ", ".join(decided))
        self._spill: _Spill | None = None

    def _bases(self) -> list[str] | None:
        if self.remote_device == "cpu":
            return None
        from tierstack.config import load_config

        return list(load_config(self.config).tier_manager.nvme_pool.paths)

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        self._spill = _Spill(self.host_bytes, self._bases(), self.dtype)
        with _patch_lock:
            _active.append(self._spill)
            torch.nn.Module.register_parameter = _register_parameter
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        with _patch_lock:
            _active.remove(self._spill)
            if not _active:
                torch.nn.Module.register_parameter = _original_register


def materialize_spilled(module: torch.nn.Module, device) -> None:
    """tierstack.initialize's `initialize` for a model built under zero.Init: each of the
    module's parameters from its spill (the engine stores it next); meta tensors are made
    as worker/engine/offload_engine.materialize makes them."""
    from tierstack.worker.engine.offload_engine import materialize

    for param in module.parameters():
        owner = owner_of(param)
        if isinstance(owner, _Spill):
            owner.take(param)
            param.data = param.data.to(device)
    materialize(module, device)


def built_under_init(model: torch.nn.Module) -> bool:
    """Whether any of `model`'s parameters waits in a zero.Init spill."""
    return any(isinstance(owner_of(p), _Spill) for p in model.parameters())


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """DeepSpeed's: a parameter used by a module that does not own it. tierstack brings a
    block's parameters in with the block, so there is nothing to register."""


class GatheredParameters:
    """DeepSpeed's zero.GatheredParameters over the tiers (module docstring)."""

    def __init__(self, params: torch.nn.Parameter | Iterable[torch.nn.Parameter],
                 modifier_rank: int | None = None, fwd_module: Any = None,
                 enabled: bool = True) -> None:
        del fwd_module  # DeepSpeed's hook registration; nothing to register here
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in (params or []) if isinstance(p, torch.Tensor)]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._owned: dict[int, tuple[Any, list[torch.nn.Parameter]]] = {}

    def __enter__(self) -> "GatheredParameters":
        if not self.enabled:
            return self
        for p in self.params:
            owner = owner_of(p)
            if owner is not None:
                self._owned.setdefault(id(owner), (owner, []))[1].append(p)
        for owner, params in self._owned.values():
            owner.gather(params)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        modified = self.modifier_rank is not None and exc[0] is None
        if modified and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Every rank writes its share of what the modifier rank changed.
            for p in self.params:
                dist.broadcast(p.data, src=self.modifier_rank)
        for owner, params in self._owned.values():
            owner.release(params, modified)
        self._owned.clear()
