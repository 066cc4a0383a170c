"""`get_accelerator()`: DeepSpeed's device abstraction, answered for the device tierstack trains on.

    from deepspeed.accelerator import get_accelerator      # with `import tierstack as deepspeed`
    device = get_accelerator().current_device_name()       # 'cuda:0', or 'cpu'

A script asks it which device to put its batches on, how many devices a node has, which
collective backend to use, and how much memory is in use. Where torch sees CUDA the
answers are torch.cuda's (DeepSpeed's CUDA_Accelerator); without CUDA they are what
DeepSpeed's CPU accelerator says: device 'cpu', backend 'gloo', and the process's
resident memory (RSS) for the memory calls, its peak kept since the last reset (DeepSpeed
reads it with psutil; here /proc/self/statm, the same figure). The choice is made once per
process, as DeepSpeed's is, and tierstack's engine puts the model on the same device
(worker/api/initialize.py: cuda:LOCAL_RANK where torch sees CUDA, else the CPU).

A call DeepSpeed's accelerators have and this one does not (op builders, graphs, triton)
raises an AttributeError naming what to use instead.
"""

from __future__ import annotations

import contextlib
import os
from functools import partial

import torch


class _Accelerator:
    """What both devices answer alike; the device's own answers are in its subclass."""

    _name = ""

    def device_name(self, device_index: int | None = None) -> str:
        """'cuda' / 'cpu', or 'cuda:<index>' for a given index (DeepSpeed's)."""
        return self._name if device_index is None else f"{self._name}:{device_index}"

    def random(self):
        return torch.random

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def is_bf16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float, torch.bfloat16]
        return dtypes + [torch.float16] if self.is_fp16_supported() else dtypes

    def is_fp16_supported(self) -> bool:
        return True

    def is_triton_supported(self) -> bool:
        return False

    def lazy_call(self, callback):
        return callback()

    def range_push(self, msg: str, domain=None, category=None) -> None:
        return None

    def range_pop(self, domain=None) -> None:
        return None

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env: dict, local_accelerator_ids) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"tierstack's accelerator has no {name}(): DeepSpeed's op builders, graphs and "
            f"kernels are not part of tierstack; call torch.{self._name} for device-specific work")

    def __repr__(self) -> str:
        return f"<tierstack accelerator {self._name!r}>"


class CudaAccelerator(_Accelerator):
    """DeepSpeed's CUDA_Accelerator: every answer is torch.cuda's."""

    _name = "cuda"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("cuda", device_index)

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def communication_backend_name(self) -> str:
        return "nccl"

    def is_synchronized_device(self) -> bool:
        return False

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported()

    # RNG
    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state() if device_index is None else torch.cuda.get_rng_state(device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if device_index is None:
            torch.cuda.set_rng_state(new_state)
        else:
            torch.cuda.set_rng_state(new_state, device_index)

    def default_generator(self, device_index: int):
        return torch.cuda.default_generators[device_index]

    # Streams and events
    @property
    def Stream(self):
        return torch.cuda.Stream

    @property
    def Event(self):
        return torch.cuda.Event

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: int | None = None):
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: int | None = None):
        return torch.cuda.default_stream(device_index)

    # Memory
    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved
    reset_max_memory_cached = reset_max_memory_allocated

    def memory_stats(self, device_index: int | None = None) -> dict:
        return torch.cuda.memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.get_device_properties(device_index).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        free, _ = torch.cuda.mem_get_info(device_index)
        return free

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    # Tensor types, as DeepSpeed's CUDA accelerator builds them
    BFloat16Tensor = property(lambda self: partial(torch.tensor, dtype=torch.bfloat16, device="cuda"))
    ByteTensor = property(lambda self: partial(torch.tensor, dtype=torch.uint8, device="cuda"))
    DoubleTensor = property(lambda self: partial(torch.tensor, dtype=torch.double, device="cuda"))
    FloatTensor = property(lambda self: partial(torch.tensor, dtype=torch.float, device="cuda"))
    HalfTensor = property(lambda self: partial(torch.tensor, dtype=torch.half, device="cuda"))
    IntTensor = property(lambda self: partial(torch.tensor, dtype=torch.int, device="cuda"))
    LongTensor = property(lambda self: partial(torch.tensor, dtype=torch.long, device="cuda"))


class CpuAccelerator(_Accelerator):
    """DeepSpeed's CPU_Accelerator: device 'cpu', backend 'gloo', and the process's
    resident memory (RSS) for the memory calls, its peak kept since the last reset."""

    _name = "cpu"

    def device_name(self, device_index: int | None = None) -> str:
        return "cpu"  # DeepSpeed's CPU accelerator names no index

    def __init__(self) -> None:
        self._peak = _rss()

    def device(self, device_index: int | None = None) -> None:
        return None  # DeepSpeed's CPU accelerator names no torch.device either

    def set_device(self, device_index: int) -> None:
        return None

    def current_device(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        """LOCAL_SIZE where a launcher set it, else 1: one CPU 'device' per node (DeepSpeed
        counts NUMA nodes for its CPU ranks; tierstack runs one rank per node on the CPU)."""
        return int(os.environ.get("LOCAL_SIZE", 0)) or 1

    def synchronize(self, device_index: int | None = None) -> None:
        return None  # CPU work is done when its call returns

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "gloo"

    def is_synchronized_device(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return False  # DeepSpeed's answer without oneDNN fp16: tierstack's CPU runs fp32 and bf16

    # RNG
    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(new_state)

    def default_generator(self, device_index: int):
        return torch.default_generator

    # Streams and events: none on the CPU (DeepSpeed's answers)
    Stream = property(lambda self: None)
    Event = property(lambda self: None)

    def stream(self, stream):
        return contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> None:
        return None

    def default_stream(self, device_index: int | None = None) -> None:
        return None

    # Memory: the process's resident bytes, as DeepSpeed's CPU accelerator counts them
    def empty_cache(self) -> None:
        return None

    def _current(self) -> int:
        rss = _rss()
        self._peak = max(self._peak, rss)
        return rss

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self._current()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        self._current()
        return self._peak

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self._peak = _rss()

    reset_max_memory_allocated = reset_peak_memory_stats
    reset_max_memory_cached = reset_peak_memory_stats
    memory_cached = memory_allocated
    memory_reserved = memory_allocated
    max_memory_cached = max_memory_allocated
    max_memory_reserved = max_memory_allocated

    def memory_stats(self, device_index: int | None = None) -> dict:
        current = self._current()
        return {"allocated_bytes.all.current": current, "allocated_bytes.all.peak": self._peak}

    def total_memory(self, device_index: int | None = None) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        return self.total_memory() - self._current()

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor  # nothing to pin for: the CPU is the device

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    BFloat16Tensor = property(lambda self: torch.BFloat16Tensor)
    ByteTensor = property(lambda self: torch.ByteTensor)
    DoubleTensor = property(lambda self: torch.DoubleTensor)
    FloatTensor = property(lambda self: torch.FloatTensor)
    HalfTensor = property(lambda self: torch.HalfTensor)
    IntTensor = property(lambda self: torch.IntTensor)
    LongTensor = property(lambda self: torch.LongTensor)


def _rss() -> int:
    """This process's resident bytes (the second field of /proc/self/statm, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


_accelerator: _Accelerator | None = None


def get_accelerator() -> CudaAccelerator | CpuAccelerator:
    """The process's accelerator: CUDA where torch sees it, else the CPU (decided once)."""
    global _accelerator
    if _accelerator is None:
        _accelerator = CudaAccelerator() if torch.cuda.is_available() else CpuAccelerator()
    return _accelerator


def set_accelerator(accelerator: _Accelerator) -> None:
    """DeepSpeed's: use `accelerator` from now on (one of this module's classes)."""
    global _accelerator
    if not isinstance(accelerator, _Accelerator):
        raise TypeError(f"set_accelerator takes tierstack's CudaAccelerator or CpuAccelerator, "
                        f"got {type(accelerator).__name__}")
    _accelerator = accelerator


def is_current_accelerator_supported() -> bool:
    return True


__all__ = ["CpuAccelerator", "CudaAccelerator", "get_accelerator", "set_accelerator",
           "is_current_accelerator_supported"]
