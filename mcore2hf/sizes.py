"""Byte sizes as users spell them (`5GB`, `5GiB`, `5G`, `1.5 MB`, `123`): parsed once, before anything is created;
formatted for reports, with the process's peak memory they state."""

from __future__ import annotations

import re
import resource

# SI units are powers of 1000, IEC units (KiB...) and bare letters (K, M, G, T: as GNU coreutils reads them)
# powers of 1024
_UNITS = {"": 1, "B": 1,
          "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
          "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")


def parse_size(size: int | str, what: str = "size") -> int:
    """Bytes from an int or a string like '5GB' (10^9), '5GiB' / '5G' (2^30), '512MiB', '123'; must be > 0."""
    if isinstance(size, bool) or not isinstance(size, int | str):
        raise ValueError(f"{what}: expected a number of bytes or a string like '5GB', got {size!r}")
    if isinstance(size, int):
        n = size
    else:
        m = _SIZE.fullmatch(size)
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"{what}: expected a size such as 5GB, 5GiB, 5G, 512MB or a number of bytes, got {size!r}")
        n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"{what}: expected a positive size, got {size!r}")
    return n


def format_size(n: float) -> str:
    for unit, mult in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= mult:
            return f"{n / mult:.2f} {unit}"
    return f"{int(n)} B"


def peak_rss() -> int:
    """This process's peak resident memory in bytes (what the offline commands report)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
