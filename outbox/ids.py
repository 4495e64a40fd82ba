"""Time-ordered event ids (UUID version 7, RFC 9562).

Python 3.11 has no ``uuid.uuid7``; this one follows the RFC layout: 48 bits of Unix
milliseconds, version and variant bits, and random bits, with a per-process counter in
``rand_a`` so ids made in the same millisecond by one process still sort in creation order.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

_lock = threading.Lock()
_last_ms = 0
_counter = 0


def uuid7() -> uuid.UUID:
    """Return a new UUIDv7 whose string form sorts by creation time."""
    global _last_ms, _counter
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
    rand_b = int.from_bytes(os.urandom(8), "big") & 0x3FFF_FFFF_FFFF_FFFF
    value = (ms & 0xFFFF_FFFF_FFFF) << 80 | 0x7 << 76 | counter << 64 | 0b10 << 62 | rand_b
    return uuid.UUID(int=value)


def new_event_id() -> str:
    """A new event id as its canonical 36-character string."""
    return str(uuid7())
