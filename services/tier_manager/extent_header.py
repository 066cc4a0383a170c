"""The header at the start of every stripe of an NVMe extent: the data describes itself.

The manifest is the index the daemon starts from, but it is one sqlite file: if it is
lost or corrupt, the data must still say what it is. So each stripe of an extent (the
part of a tensor's bytes on one drive) begins with a header naming the tensor (key,
dtype, shape, bytes), the write's sequence number (registry-wide, increasing: the newer
of two copies has the higher one), where every stripe of the extent lies, and the crc32c
of each of this stripe's blocks; a crc32c of the header itself comes last.
`tierstack tier-manager --recover` (recovery.py) rebuilds the manifest from these.

The header's size depends only on what is known before the extent is placed (key,
dtype, shape, stripe count, blocks per stripe), so the pool reserves it when it
allocates; it is whole 4 KiB pages (O_DIRECT), and a freed extent's first page is
zeroed so that a deleted tensor does not come back in a recovery.

Layout (little-endian): FIXED, then the key (UTF-8), the dtype (ASCII), the shape
(int64 each), the stripes ((drive u16, offset u64, length u64) each), the block crcs
(u32 each), and the header's crc32c (u32); zeros up to `header_len`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import crc32c

MAGIC = b"TSEXTHD1"
PAGE = 4096
_FIXED = struct.Struct("<8sHHHHIQQIIHHH")
# magic, format, slot, slots, drive, header_len, nbytes, seq, block_size, ncrc, key_len,
# dtype_len, ndim
_FORMAT = 1
_STRIPE = struct.Struct("<HQQ")
MAX_DIMS = 64
"""Dimensions a stored tensor may have (the registry refuses more)."""


@dataclass(frozen=True)
class ExtentMeta:
    """What a header says about the tensor an extent holds."""

    key: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class StripeHeader:
    """One stripe's header, decoded."""

    meta: ExtentMeta
    nbytes: int
    seq: int
    block_size: int
    slot: int
    drive: int
    header_len: int
    stripes: tuple[tuple[int, int, int], ...]  # (drive, offset, length) of every slot
    checksums: tuple[int, ...]  # this stripe's blocks, in order


def header_len(meta: ExtentMeta, slots: int, blocks_per_slot: int) -> int:
    """Bytes reserved at the start of each stripe (whole pages)."""
    size = (_FIXED.size + len(meta.key.encode()) + len(meta.dtype.encode()) + 8 * len(meta.shape)
            + _STRIPE.size * slots + 4 * blocks_per_slot + 4)
    return -(-size // PAGE) * PAGE


def encode(meta: ExtentMeta, nbytes: int, seq: int, block_size: int, slot: int, drive: int,
           length: int, stripes: tuple[tuple[int, int, int], ...], checksums: list[int]) -> bytes:
    """The header of stripe `slot`, `length` bytes (its reserved size), zero-padded."""
    key, dtype = meta.key.encode(), meta.dtype.encode()
    body = b"".join([
        _FIXED.pack(MAGIC, _FORMAT, slot, len(stripes), drive, length, nbytes, seq, block_size,
                    len(checksums), len(key), len(dtype), len(meta.shape)),
        key, dtype, struct.pack(f"<{len(meta.shape)}q", *meta.shape),
        b"".join(_STRIPE.pack(*s) for s in stripes),
        struct.pack(f"<{len(checksums)}I", *checksums)])
    body += struct.pack("<I", crc32c.crc32c(body))
    if len(body) > length:
        raise ValueError(f"header of {len(body)} bytes does not fit the {length} reserved")
    return body + bytes(length - len(body))


def peek_length(page: bytes) -> int:
    """The header length a page starting with MAGIC claims; 0 if it is no header."""
    if len(page) < _FIXED.size or page[:8] != MAGIC:
        return 0
    fields = _FIXED.unpack_from(page)
    return fields[5] if fields[1] == _FORMAT and fields[5] % PAGE == 0 else 0


def decode(data: bytes) -> StripeHeader | None:
    """A header read from disk, or None if it is not a whole, intact one."""
    try:
        (magic, fmt, slot, slots, drive, length, nbytes, seq, block_size, ncrc, key_len,
         dtype_len, ndim) = _FIXED.unpack_from(data)
        if magic != MAGIC or fmt != _FORMAT or length > len(data) or ndim > MAX_DIMS:
            return None
        at = _FIXED.size
        key = data[at:at + key_len].decode()
        at += key_len
        dtype = data[at:at + dtype_len].decode("ascii")
        at += dtype_len
        shape = struct.unpack_from(f"<{ndim}q", data, at)
        at += 8 * ndim
        stripes = tuple(_STRIPE.unpack_from(data, at + i * _STRIPE.size) for i in range(slots))
        at += _STRIPE.size * slots
        checksums = struct.unpack_from(f"<{ncrc}I", data, at)
        at += 4 * ncrc
        (stored,) = struct.unpack_from("<I", data, at)
    except (struct.error, UnicodeDecodeError, ValueError):
        return None
    if stored != crc32c.crc32c(data[:at]) or slot >= slots or block_size <= 0:
        return None
    return StripeHeader(ExtentMeta(key, dtype, tuple(shape)), nbytes, seq, block_size, slot,
                        drive, length, stripes, tuple(checksums))
