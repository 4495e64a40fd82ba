"""What the toolkit shows people: URLs without their secrets, text a terminal can print safely.

Two functions, used by every page, log line and command that shows such a value, so the rule
lives in one place:

- :func:`display_url` renders any URL (database, Redis, NATS, a provider's) for display:
  the password of its user info and every query parameter that carries a secret
  (``?password=``, a form libpq and redis-py accept, ``sslpassword``, ``token``, ...) become
  ``***``. A text that is not a URL at all is shown as ``<invalid url>``: it may be a
  connection string holding a password in a shape we do not know.
- :func:`printable` escapes control characters (C0, DEL, C1, and the Unicode line and
  bidirectional controls) in a value a terminal is about to print: a provider reference or a
  queue name holding ``ESC [2J`` cannot clear the screen or recolour the output.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit

HIDDEN = "***"

SECRET_PARAMETERS = frozenset(
    {
        "password",
        "passwd",
        "pass",
        "pwd",
        "sslpassword",
        "secret",
        "token",
        "auth",
        "access_token",
        "api_key",
        "apikey",
        "client_secret",
        "private_key",
    }
)
"""Query parameter names (lower case, ``-`` read as ``_``) whose values are hidden."""

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def _secret_name(name: str) -> bool:
    normal = name.strip().lower().replace("-", "_")
    return normal in SECRET_PARAMETERS or normal.endswith(("password", "_secret", "_token"))


_TOKEN_SCHEMES = ("nats", "tls", "ws", "wss")
"""Schemes whose user part alone is a secret: ``nats://TOKEN@host`` is NATS's token auth."""


def display_url(url: Any) -> str:
    """``url`` (text or a SQLAlchemy ``URL``) for a page, a log line or a status output:
    no password, wherever it was written. A NATS URL's lone user part (a token) is hidden
    too, and each server of a comma-separated NATS list (``nats://a,nats://b``)."""
    if url is None:
        return ""
    render = getattr(url, "render_as_string", None)
    text = render(hide_password=False) if callable(render) else str(url)
    if not _SCHEME.match(text):
        return "<invalid url>"
    scheme = text.partition("://")[0].lower()
    if scheme in _TOKEN_SCHEMES and "," in text:
        return ",".join(display_url(one.strip()) for one in text.split(","))
    try:
        parts = urlsplit(text)
        netloc = _hidden_userinfo(parts.netloc, scheme)
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            query = "&".join(
                f"{quote(k, safe='')}={HIDDEN if _secret_name(k) else quote(v, safe='/:,')}"
                for k, v in pairs
            )
        shown = f"{parts.scheme}://{netloc}{parts.path}"
        shown += f"?{query}" if query else ""
        return shown + (f"#{parts.fragment}" if parts.fragment else "")
    except ValueError:
        return "<invalid url>"


def _hidden_userinfo(netloc: str, scheme: str) -> str:
    """``user:password@host`` as ``user:***@host``; a NATS token (``TOKEN@host``) hidden."""
    userinfo, at, hostport = netloc.rpartition("@")
    if not at:
        return netloc
    user, colon, _password = userinfo.partition(":")
    if colon:
        return f"{user}:{HIDDEN}@{hostport}"
    return f"{HIDDEN if scheme in _TOKEN_SCHEMES else user}@{hostport}"


_ESCAPE = {"\t": "\\t", "\n": "\\n", "\r": "\\r", "\x1b": "\\e"}


def _unsafe(char: str) -> bool:
    # Cc: C0, DEL, C1. Cf holds the bidirectional overrides (U+202E) and zero-width marks;
    # Zl/Zp the Unicode line and paragraph separators.
    return unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp")


def printable(value: Any, *, keep_tabs: bool = False) -> str:
    """``value`` as text a terminal prints as it is: each control character becomes a
    visible escape (``\\e``, ``\\n``, ``\\x07``, ``\\u202e``); ``None`` is ``-``."""
    if value is None:
        return "-"
    text = value if isinstance(value, str) else str(value)
    if not any(_unsafe(c) for c in text):
        return text
    out = []
    for c in text:
        if c == "\t" and keep_tabs:
            out.append(c)
        elif _unsafe(c):
            code = ord(c)
            out.append(_ESCAPE.get(c) or (f"\\x{code:02x}" if code < 256 else f"\\u{code:04x}"))
        else:
            out.append(c)
    return "".join(out)


def table(rows: Sequence[Sequence[Any]], *, right: Sequence[int] = ()) -> str:
    """Rows (the first is the header) as aligned text columns, each cell through
    :func:`printable`: the one way a command prints a table. Columns in ``right`` are
    right-aligned (numbers); trailing spaces are cut."""
    cells = [[printable(c) for c in row] for row in rows]
    if not cells:
        return ""
    widths = [max(len(r[i]) for r in cells if i < len(r)) for i in range(max(map(len, cells)))]
    lines = []
    for row in cells:
        parts = [
            c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(row)
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)
