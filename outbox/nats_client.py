"""NATS for the relay and the consumer: a synchronous handle on a connection (nats-py is
asyncio, the relay and the consumer are threads), and how outbox names map onto NATS names.
One event loop runs in a daemon thread; :meth:`NatsClient.run` hands it a coroutine and
waits for the result.

The connection does not reconnect by itself (``allow_reconnect=False``): nats-py would
otherwise buffer publishes while it reconnects and send them later, maybe after another
relay has reconciled those intents. Here a lost connection fails every call in flight with
:class:`BrokerUnavailable` and is dropped; the next call connects again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

from outbox.display import HIDDEN, display_url
from outbox.errors import BrokerUnavailable, ConfigError

T = TypeVar("T")

MSG_ID = "Nats-Msg-Id"
"""The header JetStream deduplicates by: the event id (a republish of a message JetStream
still remembers but no longer holds adds ``~`` and a suffix: :func:`event_id_of`)."""
EXPECTED_STREAM = "Nats-Expected-Stream"
"""The header that makes JetStream refuse a message another stream would take."""
_SUBJECT = re.compile(r"^[^\s*>.]+(\.[^\s*>.]+)*$")
_STREAM_NAME_BAD = re.compile(r"[\s.*>/\\]")


@functools.lru_cache(maxsize=4096)  # a relay asks for the same few names per message
def jetstream_name(stream: str) -> str:
    """The JetStream stream that holds outbox stream ``stream`` (a name cannot hold ``.``,
    ``*``, ``>``, slashes or spaces: each becomes ``_``)."""
    return _STREAM_NAME_BAD.sub("_", stream)


@functools.lru_cache(maxsize=4096)
def is_subject(name: str) -> bool:
    """Whether ``name`` can be a NATS subject to publish to (dot-separated non-empty tokens
    without spaces or wildcards)."""
    return bool(_SUBJECT.match(name))


def event_id_of(msg_id: str | None) -> str | None:
    """The event id a ``Nats-Msg-Id`` carries."""
    if msg_id is None:
        return None
    return msg_id.split("~", 1)[0]


DEFAULT_TIMEOUT = 5.0
"""Seconds a call may take (a publish's acknowledgements, a lookup) before the connection
is dropped and the call fails as an outage."""


def broker_kind(url: str | None) -> str:
    """``redis`` or ``nats`` by the URL's scheme (None: the embedded Redis); anything else
    is a :class:`ConfigError` naming ``broker_url``."""
    if url is None or url == "":
        return "redis"
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster"):
        return "redis"
    if scheme in ("nats", "tls"):
        return "nats"
    raise ConfigError(
        "broker_url",
        f"{display_url(url)!r}: unknown scheme {scheme or '(none)'!r}; "
        "use redis://, rediss:// or nats://",
    )


DEFAULT_DUPLICATE_WINDOW = 120.0
"""Seconds JetStream remembers a ``Nats-Msg-Id`` (its own default)."""
DEFAULT_STREAM_RETENTION = 24 * 3600.0
"""Seconds of messages a stream keeps (``max_age``), like the outbox's own retention."""
PROVISIONAL = "outbox stream, created by a consumer before any relay"
"""The description of a stream a consumer created: the first relay to meet it sets its own
limits on it (:func:`adopt_config`)."""
RELAY_STREAM = "outbox stream"
"""The description of a stream a relay created or adopted."""


@dataclass(frozen=True)
class StreamSettings:
    """How an outbox stream is kept in JetStream: ``storage`` ``file`` or ``memory``,
    ``replicas``, ``duplicate_window`` (seconds), ``retention`` (seconds, its ``max_age``;
    0: until limits), ``maxlen`` (its ``max_msgs``) and ``max_message_bytes`` (its
    ``max_msg_size``; None: the server's). The defaults are the relay's."""

    storage: str = "file"
    replicas: int = 1
    duplicate_window: float = DEFAULT_DUPLICATE_WINDOW
    retention: float = DEFAULT_STREAM_RETENTION
    maxlen: int | None = None
    max_message_bytes: int | None = None


def stream_config(
    name: str,
    subjects: Sequence[str],
    settings: StreamSettings | None = None,
    *,
    provisional: bool = False,
) -> Any:
    """The one definition of an outbox stream (a ``nats.js.api.StreamConfig``): the relay
    creates its streams with it, and a consumer that comes first creates the stream it reads
    with it too (``provisional``: the relay's default settings, marked so that the first
    relay sets its own). So whichever process comes first, the stream is the relay's."""
    api = nats_module().js.api
    s = settings or StreamSettings()
    return api.StreamConfig(
        name=name,
        description=PROVISIONAL if provisional else RELAY_STREAM,
        subjects=list(subjects),
        storage=api.StorageType.FILE if s.storage == "file" else api.StorageType.MEMORY,
        num_replicas=s.replicas,
        duplicate_window=s.duplicate_window,
        max_age=s.retention or None,
        max_msgs=s.maxlen or None,
        max_msg_size=s.max_message_bytes or -1,
    )


DEAD_LETTERS = "outbox dead letters"
"""The description of a dead-letter stream (:func:`dead_letter_stream_config`)."""
DEAD_LETTER_MAX_BYTES = 1 << 30
"""Bytes a dead-letter stream holds (1 GiB) before JetStream refuses the next copy."""
DEAD_LETTER_MAX_MSGS = 1_000_000
"""Dead letters a dead-letter stream holds before JetStream refuses the next copy."""


def dead_letter_stream_config(name: str, subjects: Sequence[str], *, replicas: int = 1) -> Any:
    """The one definition of a dead-letter stream (a ``nats.js.api.StreamConfig``), which the
    consumer creates on its first dead letter of a stream. Unlike an outbox stream it never
    drops a dead letter by itself: file storage (``replicas`` as its outbox stream's), no
    ``max_age`` (a dead letter waits for someone, as its database record does), and
    :data:`DEAD_LETTER_MAX_BYTES` / :data:`DEAD_LETTER_MAX_MSGS` with ``discard=new``, so a
    full stream refuses the next copy (the consumer logs it as an error) rather than drop the
    oldest one. No ``max_msg_size`` (a copy carries the error text on top of the event)."""
    api = nats_module().js.api
    return api.StreamConfig(
        name=name,
        description=DEAD_LETTERS,
        subjects=list(subjects),
        storage=api.StorageType.FILE,
        num_replicas=replicas,
        duplicate_window=DEFAULT_DUPLICATE_WINDOW,
        max_bytes=DEAD_LETTER_MAX_BYTES,
        max_msgs=DEAD_LETTER_MAX_MSGS,
        discard=api.DiscardPolicy.NEW,
        max_msg_size=-1,
    )


STREAM_NAME_IN_USE = 10058
"""JetStream's error code for a stream created with a name another configuration holds: two
processes created the stream at once (the relay and a consumer), and the other one won."""


async def add_stream(js: Any, config: Any) -> Any:
    """Create the stream ``config`` describes and return its info; when another process
    created it first (:data:`STREAM_NAME_IN_USE`), the info of that one."""
    try:
        await js.add_stream(config)
    except nats_module().js.errors.BadRequestError as exc:
        if exc.err_code != STREAM_NAME_IN_USE:
            raise
    return await js.stream_info(config.name)


def adopt_config(found: Any, settings: StreamSettings) -> Any | None:
    """The configuration a relay with ``settings`` sets on stream config ``found``: None
    unless a consumer created it (:data:`PROVISIONAL`); else the relay's definition with
    the stream's own subjects and storage (JetStream cannot change a stream's storage)."""
    if getattr(found, "description", None) != PROVISIONAL:
        return None
    mine = stream_config(found.name, found.subjects or [], settings)
    mine.storage = found.storage
    return mine


def nats_module() -> Any:
    """The ``nats`` package (``pip install 'outbox-toolkit[nats]'``), or a ConfigError."""
    try:
        import nats
    except ImportError:
        raise ConfigError(
            "broker_url", "a nats:// broker needs nats-py: pip install 'outbox-toolkit[nats]'"
        ) from None
    return nats


class _Batch:
    """The acknowledgements of one :meth:`NatsClient.publish_many` call: one future for the
    batch, resolved with every reply in order once the last one came (not a future each)."""

    __slots__ = ("done", "left", "replies")

    def __init__(self, done: asyncio.Future[list[dict[str, Any]]], size: int) -> None:
        self.done = done
        self.left = size
        self.replies: list[Any] = [None] * size

    def answer(self, index: int, reply: Any) -> None:
        if self.done.done() or self.replies[index] is not None:
            return
        self.replies[index] = reply
        self.left -= 1
        if self.left == 0:
            self.done.set_result(self.replies)


def _hidden(exc: BaseException, url: str) -> str:
    """The client library's message with the URL's secrets hidden (it may quote the URL)."""
    text = str(exc)
    for one in url.split(","):
        userinfo = one.partition("://")[2].rpartition("@")[0]
        if userinfo:
            text = text.replace(userinfo, HIDDEN)
    return text


class NatsClient:
    """One NATS connection driven from other threads (see the module docstring)."""

    def __init__(self, url: str, *, timeout: float = DEFAULT_TIMEOUT, name: str = "outbox") -> None:
        if not isinstance(url, str) or not url.startswith(("nats://", "tls://")):
            raise ConfigError("broker_url", f"{display_url(url)!r} is not a nats:// URL")
        self.url = url
        self.shown = display_url(url)  # what logs and errors say: no password, no token
        self.timeout = float(timeout)
        self.name = name
        self.nats = nats_module()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="nats-client", daemon=True
        )
        self._thread.start()
        self._nc: Any = None
        self._js: Any = None
        self._lock = threading.Lock()
        self._replies: dict[str, tuple[_Batch, int]] = {}  # reply token -> its batch, index
        self._reply_prefix = ""
        self._token = 0
        # Connections made so far: what was bound to an earlier one (a consumer's pull
        # subscriptions) is bound again once this moves on (``consumer.nats_reading``).
        self.connections = 0

    # -- the loop ---------------------------------------------------------------------------

    def run(self, step: Callable[[Any], Awaitable[T]], timeout: float | None = None) -> T:
        """``await step(js)`` on the loop thread with a connected JetStream context; a
        connection failure or a timeout drops the connection and raises
        :class:`BrokerUnavailable`."""
        limit = self.timeout if timeout is None else timeout
        future = asyncio.run_coroutine_threadsafe(self._call(step, limit), self._loop)
        try:
            return future.result(limit + 2.0)
        except TimeoutError:
            future.cancel()
            self.drop()
            raise BrokerUnavailable(
                f"NATS at {self.shown} did not answer within {limit} s"
            ) from None

    async def _call(self, step: Callable[[Any], Awaitable[T]], limit: float) -> T:
        errors = self.nats.errors
        try:
            js = await self._connected()
            return await asyncio.wait_for(step(js), limit)
        except BrokerUnavailable:  # said already (no server, no TLS where tls:// says so)
            await self._close()
            raise
        except (
            TimeoutError,
            OSError,
            errors.ConnectionClosedError,
            errors.NoServersError,
            errors.StaleConnectionError,
            errors.OutboundBufferLimitError,
            errors.UnexpectedEOF,
            errors.TimeoutError,
        ) as exc:
            await self._close()
            raise BrokerUnavailable(
                f"NATS at {self.shown}: {type(exc).__name__}: {_hidden(exc, self.url)}".rstrip(": ")
            ) from exc

    async def _connected(self) -> Any:
        if self._nc is not None and self._nc.is_connected:
            return self._js
        await self._close()

        failed: list[BaseException] = []

        async def closed(*_: Any) -> None:
            return None

        async def error(exc: BaseException) -> None:
            failed.append(exc)

        tls: dict[str, Any] = {}
        if self.url.lower().startswith("tls://"):
            await self._tls_offered()
            tls["tls"] = ssl.create_default_context()
        try:
            self._nc = await self.nats.connect(
                self.url,
                **tls,
                name=self.name,
                allow_reconnect=False,
                connect_timeout=min(self.timeout, 5.0),
                # Each server of the URL tried once more at once, then NoServersError: with
                # 0, nats-py tried the one server again every 2 s for as long as the call's
                # own timeout, and the reason (refused, unknown host) was never said.
                max_reconnect_attempts=1,
                reconnect_time_wait=0,
                error_cb=error,
                disconnected_cb=closed,
            )
        except self.nats.errors.NoServersError:
            why = f"{type(failed[-1]).__name__}: {failed[-1]}" if failed else "no server answered"
            raise BrokerUnavailable(f"NATS at {self.shown}: {why}") from None
        self._js = self._nc.jetstream(timeout=self.timeout)
        self._reply_prefix = self._nc.new_inbox()
        await self._nc.subscribe(self._reply_prefix + ".*", cb=self._on_reply)
        self.connections += 1
        return self._js

    async def ack(self, msg: Any) -> None:
        """Acknowledge a JetStream message on the current connection (in the loop's thread,
        inside :meth:`run`), whichever connection delivered it: an acknowledgement is a
        publish to the message's reply subject, and one fetched before the connection was
        lost (a server restarted with its state) need not come again."""
        await self._nc.publish(msg.reply, b"+ACK")

    async def _tls_offered(self) -> None:
        """A ``tls://`` URL never talks plain text: nats-py upgrades to TLS only when the
        server's INFO says ``tls_required``, and otherwise sends its CONNECT (credentials
        included) in the clear. So the server's INFO is read first, on a connection of its
        own, and a server that does not require TLS is refused."""
        parts = urlsplit(self.url)
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(parts.hostname, parts.port or 4222),
                min(self.timeout, 5.0),
            )
        except (OSError, TimeoutError) as exc:
            raise BrokerUnavailable(f"NATS at {self.shown}: {type(exc).__name__}: {exc}") from exc
        try:
            line = await asyncio.wait_for(reader.readline(), min(self.timeout, 5.0))
        except (OSError, TimeoutError) as exc:
            raise BrokerUnavailable(f"NATS at {self.shown}: no INFO: {exc!r}") from exc
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        info: dict[str, Any] = {}
        if line.startswith(b"INFO "):
            with contextlib.suppress(ValueError):
                info = json.loads(line[5:])
        if info.get("tls_required") is not True:
            raise BrokerUnavailable(
                f"NATS at {self.shown}: the URL says tls:// but the server does not require "
                "TLS; refusing to connect in plain text (configure TLS on the server, or use "
                "nats:// if plain text is intended)"
            )

    async def _on_reply(self, msg: Any) -> None:
        found = self._replies.pop(msg.subject.rsplit(".", 1)[-1], None)
        if found is None:
            return
        batch, index = found
        if msg.headers and msg.headers.get("Status") == "503":
            reply: Any = {"error": {"code": 503, "description": "no responders"}}
        else:
            try:  # a str, not bytes: json.loads would detect the encoding of each reply
                reply = json.loads(msg.data.decode())
            except ValueError as exc:  # UnicodeDecodeError is one too
                reply = {"error": {"code": 500, "description": f"bad reply: {exc}"}}
        batch.answer(index, reply)

    async def publish_many(
        self, messages: Sequence[tuple[str, bytes, dict[str, str]]]
    ) -> list[dict[str, Any]]:
        """Publish ``(subject, body, headers)`` messages in order on this connection and
        wait for every JetStream acknowledgement: one reply each, as JetStream sent it
        (``{"stream", "seq", "duplicate"}`` or ``{"error": {...}}``; no responders is
        ``{"error": {"code": 503}}``). (nats-py's ``publish_async`` leaves a future
        unresolved when the server refuses a message, so the relay keeps its own.)"""
        assert self._nc is not None
        if not messages:
            return []
        batch = _Batch(asyncio.get_running_loop().create_future(), len(messages))
        tokens: list[str] = []
        publish, prefix, replies = self._nc.publish, self._reply_prefix + ".", self._replies
        try:
            for index, (subject, body, headers) in enumerate(messages):
                self._token += 1
                token = str(self._token)
                replies[token] = (batch, index)
                tokens.append(token)
                await publish(subject, body, reply=prefix + token, headers=headers)
            await self._nc.flush(timeout=self.timeout)
            return await batch.done
        finally:
            if not batch.done.done():
                batch.done.cancel()
            for token in tokens:  # the replies that never came
                replies.pop(token, None)

    async def _close(self) -> None:
        nc, self._nc, self._js = self._nc, None, None
        for batch, _ in self._replies.values():
            if not batch.done.done():
                batch.done.cancel()
        self._replies = {}
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(Exception):  # already gone: nothing to release
                await nc.close()

    # -- what callers use -------------------------------------------------------------------

    @property
    def max_payload(self) -> int:
        """The server's ``max_payload`` (bytes a message may carry, headers included)."""
        return int(self.run(self._max_payload))

    async def _max_payload(self, _js: Any) -> int:
        return int(self._nc.max_payload)

    def ping(self) -> None:
        """A round trip to the server (PING/PONG)."""

        async def flush(_js: Any) -> None:
            await self._nc.flush(timeout=self.timeout)

        self.run(flush)

    def xadd(self, stream: str, fields: dict[str, str]) -> str:
        """Publish ``fields`` (an entry, as JSON) to outbox stream ``stream`` and return its
        JetStream sequence: what a dead-letter replay does (``XADD`` on Redis). Its
        ``Nats-Msg-Id`` is its own (``<event id>~replay-<ns>``), never deduplicated against
        the message it replays."""
        msg_id = f"{fields.get('id', 'entry')}~replay-{time.time_ns()}"
        headers = {MSG_ID: msg_id, EXPECTED_STREAM: jetstream_name(stream)}
        body = json.dumps(fields).encode()

        async def send(_js: Any) -> list[dict[str, Any]]:
            return await self.publish_many([(stream, body, headers)])

        [reply] = self.run(send)
        if "error" in reply:
            raise BrokerUnavailable(f"JetStream refused the entry: {reply['error']}")
        return str(reply["seq"])

    def drop(self) -> None:
        """Close the connection (the next call connects again)."""
        if self._loop.is_closed():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(5.0)

    def close(self) -> None:
        """Close the connection and stop the loop thread."""
        with self._lock:
            if self._loop.is_closed():
                return
            self.drop()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)
            if not self._thread.is_alive():
                self._loop.close()


__all__ = [
    "DEAD_LETTERS",
    "DEAD_LETTER_MAX_BYTES",
    "DEAD_LETTER_MAX_MSGS",
    "DEFAULT_DUPLICATE_WINDOW",
    "DEFAULT_STREAM_RETENTION",
    "DEFAULT_TIMEOUT",
    "EXPECTED_STREAM",
    "MSG_ID",
    "PROVISIONAL",
    "RELAY_STREAM",
    "STREAM_NAME_IN_USE",
    "NatsClient",
    "StreamSettings",
    "add_stream",
    "adopt_config",
    "broker_kind",
    "dead_letter_stream_config",
    "event_id_of",
    "is_subject",
    "jetstream_name",
    "nats_module",
    "stream_config",
]
