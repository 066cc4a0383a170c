"""The bridge between torch tensors and the raw bytes the pools store."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tierstack.dtypes import dtype_from_name, dtype_name, nbytes_of
from tierstack.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A flat uint8 view of a CPU tensor's bytes (copied only if it is not contiguous)."""
    import torch

    if tensor.device.type != "cpu":
        raise InvalidArgumentError(f"expected a CPU tensor, got one on {tensor.device}")
    dtype_name(tensor.dtype)
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def tensor_from_buffer(buffer: memoryview, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor sharing `buffer`'s memory (no copy), with the given dtype and shape."""
    import torch

    expected = nbytes_of(dtype, shape)
    if len(buffer) != expected:
        raise InvalidArgumentError(
            f"buffer of {len(buffer)} bytes cannot hold {dtype}{list(shape)} ({expected} bytes)"
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype_from_name(dtype))
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    return flat.view(dtype_from_name(dtype)).view(shape)


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """memcpy between two equal-length byte buffers, with the GIL released."""
    if len(dst) != len(src):
        raise InvalidArgumentError(f"cannot copy {len(src)} bytes into a {len(dst)}-byte buffer")
    if len(src):
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
