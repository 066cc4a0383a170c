"""What every request's tensor names, shapes and placements must be, checked before
anything changes (each failure is INVALID_ARGUMENT, saying what to give instead)."""

from __future__ import annotations

from typing import Callable, Iterable

from tierstack.dtypes import check_dtype_name, nbytes_of
from tierstack.errors import InvalidArgumentError
from tierstack.services.tier_manager.extent_header import MAX_DIMS
from tierstack.tiers import PLACEMENTS, Placement

MAX_KEY_BYTES = 1024


def validate_key(key: object) -> str:
    """Keys are opaque strings: 1..1024 UTF-8 bytes, no NUL. They never name a file."""
    if not isinstance(key, str):
        raise InvalidArgumentError(f"a tensor key must be a string, got {type(key).__name__}")
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidArgumentError(f"tensor key {key!r} is not valid UTF-8") from None
    if size == 0:
        raise InvalidArgumentError("a tensor key cannot be empty")
    if size > MAX_KEY_BYTES:
        raise InvalidArgumentError(
            f"tensor key of {size} bytes is longer than {MAX_KEY_BYTES}; use a shorter name"
        )
    if "\x00" in key:
        raise InvalidArgumentError(f"tensor key {key!r} contains a NUL character")
    return key


def validate_keys(keys: Iterable[object], exists: Callable[[str], object] | None = None) -> list[str]:
    """Every key of a request, checked before any is acted on (a bad key last in a list
    must not leave the first ones evicted or deleted); `exists` raises NOT_FOUND for a key
    that is not stored."""
    keys = [validate_key(k) for k in keys]
    if exists is not None:
        for key in keys:
            exists(key)
    return keys


def validate_placement(placement: object) -> Placement:
    if placement not in PLACEMENTS:
        raise InvalidArgumentError(f"unknown placement {placement!r}; use one of {PLACEMENTS}")
    return placement  # type: ignore[return-value]


def validate_shape(shape: tuple[int, ...]) -> None:
    if len(shape) > MAX_DIMS:
        raise InvalidArgumentError(f"a tensor of {len(shape)} dimensions; at most {MAX_DIMS}")


def validate_tensor(key: str, dtype: str, shape: tuple[int, ...], placement: object) -> int:
    """A tensor a client commits: its key, dtype, shape and placement; returns its bytes."""
    validate_key(key)
    validate_placement(placement)
    validate_shape(shape)
    check_dtype_name(dtype)
    return nbytes_of(dtype, tuple(shape))


def validate_buffer_size(key: str, dtype: str, shape: tuple[int, ...], nbytes: int, held: int) -> None:
    """A committed buffer holds exactly the tensor's bytes."""
    if held != nbytes:
        raise InvalidArgumentError(
            f"tensor {key!r}: {dtype}{list(shape)} needs {nbytes} bytes but the buffer "
            f"holds {held}; allocate a buffer of exactly the tensor's size")
