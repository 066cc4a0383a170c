"""The one table of dtype names: dtypes cross the wire, the manifest and layouts by name."""

from __future__ import annotations

import math

import torch

from tierstack.errors import InvalidArgumentError

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2",
        "int8", "uint8", "int16", "int32", "int64", "bool",
    )
    if hasattr(torch, name)
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unsupported dtype {name!r}; use one of {', '.join(sorted(DTYPES))}"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise InvalidArgumentError(
            f"unsupported dtype {dtype}; use one of {', '.join(sorted(DTYPES))}"
        ) from None


def nbytes_of(dtype: str, shape: tuple[int, ...]) -> int:
    if any(d < 0 for d in shape):
        raise InvalidArgumentError(f"shape {shape} has a negative dimension")
    return math.prod(shape) * dtype_from_name(dtype).itemsize
