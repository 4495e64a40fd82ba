"""Who gets in: one token, a signed session cookie for browsers, CSRF tokens for their
changes.

- The API takes ``Authorization: Bearer TOKEN``.
- A browser signs in at ``GET /login?token=TOKEN`` (or the login form): the console sets a
  session cookie (HttpOnly, SameSite=Strict, Path=/) holding a random session id and its
  HMAC, and redirects to the overview. The key of that HMAC is derived from the token, so a
  new token signs every browser out.
- A change (POST) signed in by cookie must carry the session's CSRF token (the ``csrf`` form
  field every page's forms hold, or an ``X-CSRF-Token`` header): HMAC of the session id
  under another derived key. SameSite=Strict already keeps other sites' forms from sending
  the cookie; the CSRF token is the second lock. A bearer request carries no cookie a third
  party could ride on, so it needs none.

Every comparison of a secret is :func:`hmac.compare_digest` (constant time).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

COOKIE = "outbox_console_session"
CSRF_HEADER = "x-csrf-token"


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


class Guard:
    """Checks tokens, makes and checks session cookies and CSRF tokens."""

    def __init__(self, token: str) -> None:
        if not isinstance(token, str) or len(token) < 16:
            raise ValueError("the console token must be a text of at least 16 characters")
        self._token = token
        self._session_key = hmac.new(token.encode(), b"session", hashlib.sha256).digest()
        self._csrf_key = hmac.new(token.encode(), b"csrf", hashlib.sha256).digest()

    def token_ok(self, given: str | None) -> bool:
        return same(given, self._token)

    def new_session_cookie(self) -> str:
        session = secrets.token_urlsafe(18)
        return f"{session}.{self._sign(self._session_key, session)}"

    def session_of(self, cookie: str | None) -> str | None:
        """The session id of a cookie whose signature holds, else None."""
        if not cookie or "." not in cookie:
            return None
        session, _, signature = cookie.partition(".")
        if same(signature, self._sign(self._session_key, session)):
            return session
        return None

    def csrf_token(self, session: str) -> str:
        return self._sign(self._csrf_key, session)

    def csrf_ok(self, session: str | None, given: str | None) -> bool:
        if session is None:
            return False
        return same(given, self.csrf_token(session))

    def principal(self, authorization: str | None, cookie: str | None) -> Principal | None:
        """Who the request is, from its Authorization header or its cookie; None: nobody."""
        if authorization:
            scheme, _, value = authorization.partition(" ")
            if scheme.lower() == "bearer" and self.token_ok(value.strip()):
                return Principal("bearer")
            return None  # a wrong bearer token is refused even with a good cookie
        session = self.session_of(cookie)
        if session is not None:
            return Principal("cookie", session)
        return None

    @staticmethod
    def _sign(key: bytes, value: str) -> str:
        return hmac.new(key, value.encode(), hashlib.sha256).hexdigest()
