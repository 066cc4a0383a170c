"""Command-line value types shared by every `tierstack` command: each refuses a bad value
with one line saying what was given and what is allowed (argparse prints it after the
flag's name), so no command has to check its numbers again after parsing."""

from __future__ import annotations

import argparse
import math

from tierstack.config import AUTO_SIZE, parse_size
from tierstack.errors import ConfigError


def _number(text: str, kind: type) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def positive_float(text: str) -> float:
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def fraction(text: str) -> float:
    """A share of a whole: greater than 0, at most 1."""
    value = _number(text, float)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], got {text}")
    return value


def size(text: str) -> int:
    """Bytes with units ("64MiB", "1.5TB"), 0 or more."""
    try:
        return parse_size(text, "size")
    except ConfigError:
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a size; write bytes (4096) or a number with a unit "
            f"(64MiB, 16GiB, 1.5TB)") from None


def positive_size(text: str) -> int:
    """Bytes with units ("64MiB", "1.5TB"), more than zero."""
    value = size(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes, got {text!r}")
    return value


def positive_size_or_auto(text: str) -> int | str:
    """A pool cap: "auto" (the machine's budget decides) or bytes, more than zero."""
    if text.strip().lower() == AUTO_SIZE:
        return AUTO_SIZE
    try:
        return positive_size(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e}; or 'auto' for the machine's budget") from None
