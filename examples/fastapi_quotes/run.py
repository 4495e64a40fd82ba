"""Run the whole example with one command: the HTTP app, the relay, and billing.

    python examples/fastapi_quotes/run.py [--port 8000] [--database-url URL] [--redis-url URL]

It needs FastAPI, which the toolkit does not install (``pip install fastapi``; without it
the script says so and exits 1; uvicorn comes with the toolkit's `[console]` extra). With no
URLs everything runs on the embedded defaults, kept in ``--data-dir`` (``.outbox/``, which
git ignores, as the demo's): the SQLite file outbox.db and an embedded Redis server (the
three processes run in that folder). Three processes are started:

- ``uvicorn app:app``: quotes approved over HTTP, events written with AsyncOutbox;
- ``outbox-relay run``: committed events -> Redis Streams;
- ``billing.py``: a consumer that makes one "send the quote" job per approved quote, and a
  worker that runs the jobs.

Ctrl-C (or SIGTERM) stops all three; so does any of them exiting. Then try:

    curl -s -XPOST localhost:8000/quotes -H 'content-type: application/json' \\
         -d '{"tenant": "studio", "total": 120}'
    curl -s -XPOST localhost:8000/quotes/1/approve
    curl -s localhost:8000/quotes/1        # "job": {"state": "DONE", ...} a moment later
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RELAY = "import sys; from relay.cli import main; sys.exit(main(sys.argv[1:]))"


NEEDS = ("fastapi", "uvicorn")
"""What this example imports beyond the toolkit's own code: fastapi (``pip install
fastapi``) and uvicorn (the toolkit's `[console]` extra, checked all the same)."""


def missing_requirements() -> list[str]:
    missing = []
    for name in NEEDS:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def main(argv: list[str] | None = None) -> int:
    missing = missing_requirements()
    if missing:
        print(
            f"this example needs {' and '.join(missing)}, not installed here: "
            f"pip install {' '.join(missing)}",
            file=sys.stderr,
        )
        return 1
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--database-url", default=os.environ.get("QUOTES_DATABASE_URL"))
    parser.add_argument("--redis-url", default=os.environ.get("QUOTES_REDIS_URL"))
    parser.add_argument("--stream", default=os.environ.get("QUOTES_STREAM", "outbox.{topic}"))
    parser.add_argument("--group", default=os.environ.get("QUOTES_GROUP", "billing"))
    parser.add_argument(
        "--data-dir",
        default=".outbox",
        help="where the embedded SQLite file and Redis live when no URL is given [.outbox]",
    )
    args = parser.parse_args(argv)
    data_dir = Path(args.data_dir).resolve()
    if not (args.database_url and args.redis_url):
        data_dir.mkdir(parents=True, exist_ok=True)
    if not args.database_url:
        args.database_url = f"sqlite:///{data_dir / 'outbox.db'}"
    # The embedded Redis lives in the working directory of the processes that use it.
    workdir = str(data_dir) if not args.redis_url else os.getcwd()

    env = dict(os.environ)
    env["QUOTES_STREAM"] = args.stream
    env["QUOTES_GROUP"] = args.group
    if args.database_url:
        env["QUOTES_DATABASE_URL"] = args.database_url
    if args.redis_url:
        env["QUOTES_REDIS_URL"] = args.redis_url
    # The example's modules import from the checkout's packages when run from it.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HERE), str(HERE.parents[1]), env.get("PYTHONPATH")) if p
    )
    relay_args = ["--stream", args.stream, "--poll-interval", "0.02"]
    if args.database_url:
        relay_args += ["--database-url", args.database_url]
    if args.redis_url:
        relay_args += ["--redis-url", args.redis_url]
    commands = {
        "app": [
            sys.executable, "-m", "uvicorn", "app:app",
            "--host", args.host, "--port", str(args.port), "--log-level", "warning",
        ],
        "relay": [sys.executable, "-c", RELAY, "run", *relay_args],
        "billing": [sys.executable, str(HERE / "billing.py")],
    }  # fmt: skip
    children: dict[str, subprocess.Popen[bytes]] = {}
    stopping = False
    failed = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        for name, command in commands.items():
            children[name] = subprocess.Popen(command, env=env, cwd=workdir)
        print(f"quotes app on http://{args.host}:{args.port} (Ctrl-C stops everything)", flush=True)
        while not stopping:
            for name, child in children.items():
                if child.poll() is not None:
                    print(f"{name} exited with {child.returncode}; stopping", file=sys.stderr)
                    stopping = True
                    failed = True  # a child that stops by itself is a failure of the run
            time.sleep(0.2)
    finally:
        for child in children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for child in children.values():
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
