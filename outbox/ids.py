"""Time-ordered event ids (UUID version 7, RFC 9562).

Python 3.11 has no ``uuid.uuid7``; this one follows the RFC layout: 48 bits of Unix
milliseconds, version and variant bits, and random bits, with a per-process counter in
``rand_a`` so ids made in the same millisecond by one process still sort in creation order.

The random bits come from ``os.urandom`` drawn 4 KiB at a time (512 ids), not 8 bytes per
id: ``os.urandom`` releases the GIL around its system call, and with several writer threads
each release handed the interpreter to another thread and queued this one behind it, once per
event (issue 25: part of the session writer's extra client CPU at 8 threads). A forked child
drops the parent's unused bytes, so parent and child never share random bits.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

_lock = threading.Lock()
_last_ms = 0
_counter = 0
_RANDOM_CHUNK = 4096
_random = b""
_random_at = 0


def _forget_random() -> None:
    global _random, _random_at
    _random, _random_at = b"", 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_random)


def _uuid7_int() -> int:
    global _last_ms, _counter, _random, _random_at
    with _lock:
        ms = time.time_ns() // 1_000_000
        if ms <= _last_ms:
            _counter += 1
            if _counter > 0xFFF:  # counter spent within one millisecond: borrow the next one
                _last_ms += 1
                _counter = 0
            ms = _last_ms
        else:
            _last_ms = ms
            _counter = 0
        counter = _counter
        if _random_at >= len(_random):
            _random, _random_at = os.urandom(_RANDOM_CHUNK), 0
        at = _random_at
        _random_at = at + 8
        rand_b = int.from_bytes(_random[at : at + 8], "big") & 0x3FFF_FFFF_FFFF_FFFF
    return (ms & 0xFFFF_FFFF_FFFF) << 80 | 0x7 << 76 | counter << 64 | 0b10 << 62 | rand_b


def uuid7() -> uuid.UUID:
    """Return a new UUIDv7 whose string form sorts by creation time."""
    return uuid.UUID(int=_uuid7_int())


def new_event_id() -> str:
    """A new event id as its canonical 36-character string (``str(uuid7())``, formatted
    directly rather than through a ``uuid.UUID``)."""
    h = f"{_uuid7_int():032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
