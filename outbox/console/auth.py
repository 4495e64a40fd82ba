"""Who gets in: one token, a signed session cookie for browsers, CSRF tokens for their
changes.

- The API takes ``Authorization: Bearer TOKEN``.
- A browser signs in at ``GET /login?token=TOKEN`` (or the login form): the console sets a
  session cookie (HttpOnly, SameSite=Strict, Path=/, Secure behind TLS) holding a random
  session id and its HMAC, and redirects to the page asked for. Sessions live on the server
  (:class:`Sessions`): each has an idle expiry (:data:`IDLE_SECONDS` without a request) and an
  absolute one (:data:`ABSOLUTE_SECONDS` after sign-in), ``POST /logout`` deletes it, and a new
  token (:meth:`Guard.rotate`, a changed ``--token-file``) deletes them all. A cookie is
  only a handle: one whose session is gone lets nobody in, whatever its signature.
- Wrong tokens are throttled per client (:class:`Throttle`): after
  :data:`FAILURES_PER_WINDOW` failures within :data:`WINDOW_SECONDS`, that client's sign-ins
  and bearer requests are answered 429 until the window has passed, without being checked.
- A change (POST) signed in by cookie must carry the session's CSRF token (the ``csrf`` form
  field every page's forms hold, or an ``X-CSRF-Token`` header): HMAC of the session id
  under another derived key. SameSite=Strict already keeps other sites' forms from sending
  the cookie; the CSRF token is the second lock. A bearer request carries no cookie a third
  party could ride on, so it needs none.

Every comparison of a secret is :func:`hmac.compare_digest` (constant time).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

COOKIE = "outbox_console_session"
CSRF_HEADER = "x-csrf-token"

IDLE_SECONDS = 30 * 60.0
"""A session no request used for this long is over."""
ABSOLUTE_SECONDS = 12 * 3600.0
"""A session is over this long after its sign-in, however busy."""
MAX_SESSIONS = 10_000
"""At most this many live sessions (the oldest go first): sign-ins cannot fill the memory."""
FAILURES_PER_WINDOW = 30
WINDOW_SECONDS = 60.0


def generate_token() -> str:
    """A fresh console token (when neither OUTBOX_CONSOLE_TOKEN nor --token-file gives one)."""
    return secrets.token_urlsafe(32)


def same(given: str | None, expected: str) -> bool:
    """Constant-time equality of two secrets (a missing one is never equal)."""
    if given is None:
        return False
    return hmac.compare_digest(given.encode("utf-8", "replace"), expected.encode())


@dataclass(frozen=True)
class Principal:
    """A request that got in: how (``bearer`` or ``cookie``) and, for a cookie, its
    session id (what its CSRF token is derived from)."""

    via: str
    session: str | None = None


class Sessions:
    """The live browser sessions, on the server: id -> (signed in at, last used at).
    ``clock`` is a parameter (tests move time)."""

    def __init__(
        self,
        *,
        idle: float = IDLE_SECONDS,
        absolute: float = ABSOLUTE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < idle <= absolute:
            raise ValueError("session expiry: 0 < idle <= absolute")
        self.idle, self.absolute, self.clock = idle, absolute, clock
        self._live: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def open(self) -> str:
        session = secrets.token_urlsafe(18)
        now = self.clock()
        with self._lock:
            while len(self._live) >= MAX_SESSIONS:
                del self._live[next(iter(self._live))]  # the oldest sign-in
            self._live[session] = (now, now)
        return session

    def touch(self, session: str) -> bool:
        """Whether ``session`` is live; if it is, it was just used."""
        now = self.clock()
        with self._lock:
            found = self._live.get(session)
            if found is None:
                return False
            started, used = found
            if now - used > self.idle or now - started > self.absolute:
                del self._live[session]
                return False
            self._live[session] = (started, now)
            return True

    def close(self, session: str | None) -> None:
        with self._lock:
            self._live.pop(session or "", None)

    def clear(self) -> None:
        with self._lock:
            self._live.clear()

    def __len__(self) -> int:
        return len(self._live)


class Throttle:
    """Failed token checks per client address, in a sliding window."""

    def __init__(
        self,
        limit: int = FAILURES_PER_WINDOW,
        window: float = WINDOW_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit, self.window, self.clock = limit, window, clock
        self._failures: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def _recent(self, client: str, now: float) -> deque[float]:
        failures = self._failures.setdefault(client, deque())
        while failures and now - failures[0] > self.window:
            failures.popleft()
        return failures

    def retry_after(self, client: str) -> float:
        """0 when ``client`` may try a token now, else the seconds until it may."""
        now = self.clock()
        with self._lock:
            failures = self._recent(client, now)
            if len(failures) < self.limit:
                if not failures:
                    self._failures.pop(client, None)
                return 0.0
            return max(0.0, self.window - (now - failures[0]))

    def failed(self, client: str) -> None:
        now = self.clock()
        with self._lock:
            if len(self._failures) > MAX_SESSIONS:  # many addresses: forget the quiet ones
                for key in [k for k, v in self._failures.items() if not v or now - v[-1] > 60]:
                    del self._failures[key]
            self._recent(client, now).append(now)


class Guard:
    """Checks tokens, makes and checks session cookies and CSRF tokens. ``token`` is the
    token, or a function returning the current one (a token file that may change): a new
    token closes every session."""

    def __init__(self, token: str | Callable[[], str], sessions: Sessions | None = None) -> None:
        self._source = token if callable(token) else None
        self.sessions = sessions if sessions is not None else Sessions()
        self.throttle = Throttle()
        self._token = ""
        self.rotate(token() if callable(token) else token)

    def rotate(self, token: str) -> None:
        """Use ``token`` from now on; when it differs from the current one, every session
        ends (and every CSRF token with it)."""
        if not isinstance(token, str) or len(token) < 16:
            raise ValueError("the console token must be a text of at least 16 characters")
        if token == self._token:
            return
        self._token = token
        self._session_key = hmac.new(token.encode(), b"session", hashlib.sha256).digest()
        self._csrf_key = hmac.new(token.encode(), b"csrf", hashlib.sha256).digest()
        self.sessions.clear()

    def _current(self) -> None:
        if self._source is not None:
            # an unreadable or half-written file keeps the token in force
            with contextlib.suppress(OSError, ValueError):
                self.rotate(self._source())

    def token_ok(self, given: str | None) -> bool:
        self._current()
        return same(given, self._token)

    def new_session_cookie(self) -> str:
        session = self.sessions.open()
        return f"{session}.{self._sign(self._session_key, session)}"

    def session_of(self, cookie: str | None) -> str | None:
        """The session id of a cookie whose signature holds and whose session is live."""
        if not cookie or "." not in cookie:
            return None
        self._current()
        session, _, signature = cookie.partition(".")
        if same(signature, self._sign(self._session_key, session)) and self.sessions.touch(session):
            return session
        return None

    def end_session(self, cookie: str | None) -> None:
        """Sign out: the cookie's session is over, on the server."""
        session = self.session_of(cookie)
        if session is not None:
            self.sessions.close(session)

    def csrf_token(self, session: str) -> str:
        return self._sign(self._csrf_key, session)

    def csrf_ok(self, session: str | None, given: str | None) -> bool:
        if session is None:
            return False
        return same(given, self.csrf_token(session))

    def bearer(self, authorization: str | None) -> bool | None:
        """None: no bearer token given; else whether it is the token."""
        if not authorization:
            return None
        scheme, _, value = authorization.partition(" ")
        return scheme.lower() == "bearer" and self.token_ok(value.strip())

    def principal(self, authorization: str | None, cookie: str | None) -> Principal | None:
        """Who the request is, from its Authorization header or its cookie; None: nobody."""
        bearer = self.bearer(authorization)
        if bearer is not None:
            # a wrong bearer token is refused even with a good cookie
            return Principal("bearer") if bearer else None
        session = self.session_of(cookie)
        if session is not None:
            return Principal("cookie", session)
        return None

    @staticmethod
    def _sign(key: bytes, value: str) -> str:
        return hmac.new(key, value.encode(), hashlib.sha256).hexdigest()
