"""The one table of dtype names: dtypes cross the wire, the manifest and layouts by name.

The names and their sizes need no torch: the tier-manager daemon checks and sizes
tensors by name and imports torch only when it runs an optimizer step (torch's import is
most of a daemon's start, and tests and jobs start many daemons)."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

from tierstack.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

# torch's own itemsizes; tests/test_dtypes.py checks them against torch.
ITEMSIZES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8, "bool": 1,
}


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {name: getattr(torch, name) for name in ITEMSIZES}


def check_dtype_name(name: str) -> str:
    if name not in ITEMSIZES:
        raise InvalidArgumentError(f"unsupported dtype {name!r}; use one of {', '.join(sorted(ITEMSIZES))}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    return _torch_dtypes()[check_dtype_name(name)]


@functools.cache
def _names() -> dict[torch.dtype, str]:
    return {dtype: name for name, dtype in _torch_dtypes().items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _names()[dtype]
    except KeyError:
        pass
    raise InvalidArgumentError(f"unsupported dtype {dtype}; use one of {', '.join(sorted(ITEMSIZES))}")


def nbytes_of(dtype: str, shape: tuple[int, ...]) -> int:
    if any(d < 0 for d in shape):
        raise InvalidArgumentError(f"shape {shape} has a negative dimension")
    return math.prod(shape) * ITEMSIZES[check_dtype_name(dtype)]
