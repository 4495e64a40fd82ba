"""The flag declarations of every command line (:mod:`outbox.cli` re-exports all of it).

- :class:`Flag`: one flag, its ``OUTBOX_*`` variable, its help and its default; declared
  flags are added to a parser with :func:`add_flags`, and after parsing
  :func:`resolve_environment` fills in what the command line did not give (:func:`given_as`
  tells where a value came from, :func:`declared_flag` finds a parser's declarations).
- :func:`parse_bool`: the one boolean parser (``1/0``, ``true/false``, ``yes/no``,
  ``on/off``).
- The shared groups :data:`DATABASE`, :data:`REDIS`, :data:`METRICS` and :data:`LOGGING`,
  with the value types they use (:func:`port`, :func:`log_level`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from outbox.errors import ConfigError
from outbox.validate import INT64_MAX, float_problem, int_problem

ENV_PREFIX = "OUTBOX_"

# -- values -------------------------------------------------------------------------------------

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})


def parse_bool(raw: str, name: str = "value") -> bool:
    """``1/0``, ``true/false``, ``yes/no``, ``on/off`` (any case); ConfigError naming ``name``
    otherwise."""
    word = raw.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ConfigError(name, f"{raw!r} is not a boolean (1/0, true/false, yes/no, on/off)")


class BadValue(argparse.ArgumentTypeError, ValueError):
    """A flag's text the value's gate refused: argparse prints its message (``argument
    --port: must be from 0 to 65535, got 70000``) and exits 2."""


def whole_number(raw: str) -> int:
    """A count, a size, an id from the command line or a variable: ASCII digits only (no
    fullwidth or superscript digits, no sign, no underscore), 0 to 2**63-1. What a flag
    declared with ``int`` parses with (:attr:`Flag.parser`)."""
    problem = int_problem(raw, minimum=0, maximum=INT64_MAX)
    if problem is not None:
        raise BadValue(problem)
    return int(raw)


def finite_number(raw: str) -> float:
    """Seconds, a rate, a fraction from the command line or a variable: ASCII digits with an
    optional decimal point (no ``nan``, ``inf``, sign or exponent). What a flag declared with
    ``float`` parses with (:attr:`Flag.parser`): ``--window nan`` or
    ``OUTBOX_INBOUND_WINDOW=inf`` must not turn a check off."""
    problem = float_problem(raw)
    if problem is not None:
        raise BadValue(problem)
    return float(raw)


_TYPE_WORDS: dict[Any, str] = {
    whole_number: "an integer in ASCII digits (0 or more)",
    finite_number: "a number in ASCII digits (like 30 or 2.5)",
}
_STRICT: dict[Any, Callable[[str], Any]] = {int: whole_number, float: finite_number}


def describe_default(value: Any) -> str:
    """A default as the help and the reference page show it (``1``, not ``1.0``)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


@dataclass(frozen=True)
class Flag:
    """One command-line flag with its ``OUTBOX_*`` environment variable.

    ``type`` parses a string (``int``, ``float``, ``str`` or any function raising
    ValueError); ``bool`` makes a switch (``--no-listen``) whose variable takes
    :func:`parse_bool`'s words. ``env`` is derived from the name unless given; ``None`` means
    no variable. ``shown_default`` is the default as the help tells it, when ``default`` is
    None because the command decides later (``outbox.db in the working directory``).
    ``env_negates``: the variable of a switch says the opposite (``--no-lookup`` and
    ``OUTBOX_SIMULATOR_LOOKUP=0``). ``aliases``: older names of the flag that still work
    (``--redis-url`` for ``--broker-url``); ``env_fallback``: the variable read when
    ``env`` is not set (the alias's, ``OUTBOX_REDIS_URL``).
    """

    name: str
    type: Callable[[str], Any] = str
    help: str = ""
    default: Any = None
    env: str | None = ""
    shown_default: str | None = None
    metavar: str | None = None
    dest: str | None = None
    choices: Sequence[str] | None = None
    env_negates: bool = False
    aliases: tuple[str, ...] = ()
    env_fallback: str | None = None

    @property
    def switch(self) -> bool:
        return self.type is bool

    @property
    def env_var(self) -> str | None:
        if self.env is None:
            return None
        if self.env:
            return self.env
        return ENV_PREFIX + self.name.lstrip("-").replace("-", "_").upper()

    @property
    def attribute(self) -> str:
        return self.dest or self.name.lstrip("-").replace("-", "_")

    def default_text(self) -> str | None:
        if self.shown_default is not None:
            return self.shown_default
        if self.default is None or (self.switch and self.default is False):
            return None
        return describe_default(self.default)

    def full_help(self) -> str:
        notes = []
        if self.env_var:
            value = ("=false" if self.env_negates else "=true") if self.switch else ""
            notes.append(f"env {self.env_var}{value}")
        default = self.default_text()
        if default is not None:
            notes.append(f"default {default}")
        text = self.help
        if notes:
            text = f"{text} ({'; '.join(notes)})" if text else "; ".join(notes)
        return text

    @property
    def parser(self) -> Callable[[str], Any]:
        """What parses the flag's text: ``int`` and ``float`` declarations are read strictly
        (:func:`whole_number`, :func:`finite_number`: the one gate of numbers given as
        text), any other type as declared."""
        return _STRICT.get(self.type, self.type)

    def parse(self, raw: str, source: str) -> Any:
        """``raw`` read from ``source`` (the variable's name), or ConfigError naming it."""
        if self.switch:
            return parse_bool(raw, source) != self.env_negates
        try:
            return self.parser(raw)
        except (ValueError, OverflowError, argparse.ArgumentTypeError) as exc:
            what = _TYPE_WORDS.get(self.parser)
            problem = f"{raw!r} is not {what}" if what else f"{raw!r}: {exc}"
            raise ConfigError(source, problem) from None

    def resolve(self, environ: Any = None) -> Any:
        """The value when the flag was not given: its variable's, else the default."""
        environ = os.environ if environ is None else environ
        name = self.env_var
        raw = environ.get(name) if name else None
        if (raw is None or raw == "") and self.env_fallback:
            name = self.env_fallback
            raw = environ.get(name)
        if raw is None or raw == "":
            return self.default
        value = self.parse(raw, name or self.name)
        if self.choices is not None and value not in self.choices:
            raise ConfigError(name or self.name, f"{raw!r} is not one of {', '.join(self.choices)}")
        return value

    def add_to(self, parser: argparse._ActionsContainer) -> None:
        kwargs: dict[str, Any] = {
            "dest": self.attribute,
            "default": _Pending(self),
            "help": self.full_help().replace("%", "%%"),
        }
        if self.switch:
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = self.parser
            if self.metavar:
                kwargs["metavar"] = self.metavar
            if self.choices is not None:
                kwargs["choices"] = self.choices
        parser.add_argument(self.name, *self.aliases, **kwargs)


_Container = TypeVar("_Container", bound=argparse._ActionsContainer)


@dataclass(frozen=True)
class _Pending:
    """The argparse default of a declared flag: resolved from the environment after parsing
    (only for the subcommand that was chosen), so a bad variable of another subcommand never
    gets in the way."""

    flag: Flag = field()

    def __repr__(self) -> str:  # what argparse would print as the default
        return repr(self.flag.default)


def add_flags(parser: _Container, *flags: Flag) -> _Container:
    """Add each declared flag to ``parser`` (a subcommand's parser, or a group of one: a
    mutually exclusive ``--since`` / ``--from-seq`` is two declarations too)."""
    for flag in flags:
        flag.add_to(parser)
    return parser


_SOURCES = "_flag_sources"


def resolve_environment(namespace: argparse.Namespace, environ: Any = None) -> argparse.Namespace:
    """Replace every flag not given on the command line by its variable's value or default
    (:func:`given_as` tells which it was)."""
    environ = os.environ if environ is None else environ
    sources: dict[str, str] = getattr(namespace, _SOURCES, {})
    for key, value in list(vars(namespace).items()):
        if isinstance(value, _Pending):
            flag = value.flag
            setattr(namespace, key, flag.resolve(environ))
            names = (flag.env_var, flag.env_fallback)
            sources[key] = next((n for n in names if n and environ.get(n)), "")
    setattr(namespace, _SOURCES, sources)
    return namespace


def given_as(args: argparse.Namespace, flag: Flag) -> str:
    """How ``flag``'s value was given: its name (the command line), its variable's name
    (the environment), or "" (the default): for messages about a flag that cannot apply."""
    sources: dict[str, str] = getattr(args, _SOURCES, {})
    return sources.get(flag.attribute, flag.name)


def declared_flag(action: argparse.Action) -> Flag | None:
    """The :class:`Flag` declaration an argparse action was added from, or None (an option
    added by hand, ``--help``)."""
    return action.default.flag if isinstance(action.default, _Pending) else None


def declared_flags(parser: argparse.ArgumentParser) -> list[Flag]:
    """The :class:`Flag` declarations of ``parser`` (for the reference page)."""
    return [a.default.flag for a in parser._actions if isinstance(a.default, _Pending)]


# -- shared groups ------------------------------------------------------------------------------

DATABASE_URL = Flag(
    "--database-url",
    help="SQLAlchemy URL (postgresql://... or sqlite:///file.db)",
    shown_default="the SQLite file outbox.db in the working directory",
    metavar="URL",
)
REDIS_URL = Flag(
    "--broker-url",
    help="the broker: redis://host:port/db, rediss://..., or nats://host:port (NATS "
    "JetStream); --redis-url and OUTBOX_REDIS_URL are its older names",
    shown_default="an embedded Redis server",
    metavar="URL",
    dest="redis_url",
    aliases=("--redis-url",),
    env="OUTBOX_BROKER_URL",
    env_fallback="OUTBOX_REDIS_URL",
)
BROKER_URL = REDIS_URL
REDIS_CLUSTER = Flag(
    "--redis-cluster",
    bool,
    "--broker-url names any node of a Redis Cluster (a redis+cluster:// URL says the same)",
)


def port(raw: str) -> int:
    """A TCP port from the command line or a variable: ASCII digits, 0 to 65535."""
    problem = int_problem(raw, minimum=0, maximum=65535)
    if problem is not None:
        raise BadValue(problem)
    return int(raw)


_TYPE_WORDS[port] = "a port (0 to 65535)"


def log_level(raw: str) -> str:
    """A log level, in any case: debug, info, warning or error."""
    level = raw.strip().lower()
    if level not in LOG_LEVELS:
        raise ValueError(f"not one of {', '.join(LOG_LEVELS)}")
    return level


LOG_LEVELS = ("debug", "info", "warning", "error")

METRICS_PORT = Flag(
    "--metrics-port",
    port,
    "serve Prometheus metrics on this port",
    shown_default="no metrics server",
    metavar="PORT",
)
METRICS_HOST = Flag(
    "--metrics-host", help="address of the metrics server", default="127.0.0.1", metavar="HOST"
)
LOG_LEVEL = Flag(
    "--log-level", log_level, "debug, info, warning, error", default="info", metavar="LEVEL"
)

DATABASE: tuple[Flag, ...] = (DATABASE_URL,)
REDIS: tuple[Flag, ...] = (REDIS_URL, REDIS_CLUSTER)
METRICS: tuple[Flag, ...] = (METRICS_PORT, METRICS_HOST)
LOGGING: tuple[Flag, ...] = (LOG_LEVEL,)
