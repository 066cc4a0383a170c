"""What every request's tensor names, shapes and placements must be, checked before
anything changes (each failure is INVALID_ARGUMENT, saying what to give instead)."""

from __future__ import annotations

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


def validate_placement(placement: object) -> Placement:
    if placement not in PLACEMENTS:
        raise InvalidArgumentError(f"unknown placement {placement!r}; use one of {PLACEMENTS}")
    return placement  # type: ignore[return-value]


def validate_shape(shape: tuple[int, ...]) -> None:
    if len(shape) > MAX_DIMS:
        raise InvalidArgumentError(f"a tensor of {len(shape)} dimensions; at most {MAX_DIMS}")
