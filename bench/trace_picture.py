"""One quote's trace as a timeline (docs/images/trace.png), drawn from spans exported by real
processes: a domain process, ``outbox-relay run``, ``outbox-consumer run`` and
``outbox-worker run`` under ``opentelemetry-instrument``, exporting OTLP/HTTP to a receiver
here, and the connector simulator as the provider (the moment it received the request).

    python -m bench trace_picture [--quotes 3] [--out docs/images/trace.png]

The setup is tests/test_tracing_processes.py's (its apps: ``tests.tracing_app``), on the
shared PostgreSQL (a schema of its own, dropped after) and Redis (a stream of its own).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # tests.* live in the checkout, beside bench/
    sys.path.insert(0, str(ROOT))

import sqlalchemy as sa  # noqa: E402

from tests.services import wait_for  # noqa: E402
from tests.simulator_support import SimulatorProcess  # noqa: E402
from tests.tracing_support import OtlpReceiver, ReceivedSpan  # noqa: E402

PG = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
REDIS = "redis://127.0.0.1:6379/0"
BIN = Path(sys.executable).parent
COLORS = {
    "domain": "#4c72b0",
    "relay": "#dd8452",
    "consumer": "#55a868",
    "worker": "#c44e52",
    "provider": "#8172b3",
}


def collect(quotes: int) -> tuple[list[ReceivedSpan], list[dict[str, Any]]]:
    """Run the processes, return every span received and the simulator's effects."""
    schema = f"trace_picture_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(PG, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    url = f"{PG}?options=-csearch_path%3D{schema}"
    prefix = f"trace-picture-{uuid.uuid4().hex[:8]}"
    receiver = OtlpReceiver()
    processes: list[subprocess.Popen[str]] = []
    try:
        with tempfile.TemporaryDirectory() as tmp, SimulatorProcess(Path(tmp) / "sim.db") as sim:
            base = {
                **os.environ,
                "PYTHONPATH": str(ROOT),
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_METRICS_EXPORTER": "none",
                "OTEL_LOGS_EXPORTER": "none",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
                "OTEL_BSP_SCHEDULE_DELAY": "200",
                "TRACING_STREAM": f"{prefix}.outbox.quote.approved",
                "TRACING_DATABASE_URL": url,
                "SIM_URL": sim.url,
            }
            agent = str(BIN / "opentelemetry-instrument")
            common = ["--database-url", url, "--redis-url", REDIS]
            subprocess.run(
                [agent, sys.executable, str(ROOT / "tests" / "tracing_app.py"), url, "0"],
                env={**base, "OTEL_SERVICE_NAME": "domain"},
                check=True,
                cwd=ROOT,
            )  # the schema, before the processes start
            commands = {
                "relay": [str(BIN / "outbox-relay"), "run", *common],
                "consumer": [str(BIN / "outbox-consumer"), "run", "tests.tracing_app:consumer"],
                "worker": [str(BIN / "outbox-worker"), "run", "tests.tracing_app:worker"],
            }
            commands["relay"] += ["--stream", f"{prefix}.outbox.{{topic}}"]
            commands["consumer"] += common
            commands["worker"] += common[:2]
            for service, command in commands.items():
                processes.append(
                    subprocess.Popen(
                        [agent, *command],
                        env={**base, "OTEL_SERVICE_NAME": service},
                        cwd=ROOT,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        text=True,
                    )
                )
            time.sleep(2.0)  # let them start and go idle, so the picture shows a warm path
            subprocess.run(
                [agent, sys.executable, str(ROOT / "tests" / "tracing_app.py"), url, str(quotes)],
                env={**base, "OTEL_SERVICE_NAME": "domain"},
                check=True,
                cwd=ROOT,
            )
            wait_for(lambda: len(sim.effects()) >= quotes, "every quote sent", timeout=120)
            for proc in processes:
                proc.send_signal(signal.SIGTERM)
            for proc in processes:
                proc.wait(timeout=60)
            effects = sim.effects()
        return list(receiver.spans), effects
    finally:
        for proc in processes:
            if proc.poll() is None:
                proc.kill()
        receiver.close()
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


def draw(spans: list[ReceivedSpan], effects: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_id = {s.span_id: s for s in spans}
    effect = effects[len(effects) // 2]  # a quote from the middle of the run
    _, trace_id, sender_id, _ = effect["headers"]["traceparent"].split("-")
    chain = [by_id[sender_id]]
    while chain[-1].parent_span_id:
        chain.append(by_id[chain[-1].parent_span_id])
    domain = chain[-1]
    trace = sorted((s for s in spans if s.trace_id == trace_id), key=lambda s: s.start_ns)
    publish = next(s for s in spans if (domain.trace_id, domain.span_id) in s.links)
    rows = [trace[0], publish, *trace[1:]]
    origin = domain.start_ns
    fig, ax = plt.subplots(figsize=(10, 0.55 * (len(rows) + 1) + 1.2))
    labels = []
    for y, span in enumerate(rows):
        start = (span.start_ns - origin) / 1e6
        width = max((span.end_ns - span.start_ns) / 1e6, 0.15)
        ax.barh(y, width, left=start, color=COLORS.get(span.service, "grey"), height=0.6)
        ax.text(start + width + 0.3, y, f"{width:.1f} ms", va="center", fontsize=8)
        own = "" if span is not publish else "  (own trace, linked)"
        labels.append(f"{span.service}: {span.name}{own}")
    y_provider = len(rows)
    at = (float(effect["time"]) * 1e9 - origin) / 1e6
    ax.plot([at], [y_provider], marker="D", color=COLORS["provider"], markersize=8)
    ax.text(at + 0.3, y_provider, "  traceparent received", va="center", fontsize=8)
    labels.append("provider: request")
    y_publish = rows.index(publish)
    ax.annotate(
        "",
        xy=((publish.start_ns - origin) / 1e6, y_publish),
        xytext=((domain.end_ns - origin) / 1e6, 0),
        arrowprops={"arrowstyle": "->", "linestyle": "--", "color": "grey"},
    )
    ax.set_yticks(range(len(labels)), labels, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds since the domain span started")
    ax.set_title(f"One quote, one trace ({trace_id[:12]}...): spans exported by each process")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}: trace {trace_id}, {len(rows)} spans")
    for span in rows:
        print(
            f"  {span.service:9s} {span.name:28s} +{(span.start_ns - origin) / 1e6:8.1f} ms"
            f"  {(span.end_ns - span.start_ns) / 1e6:7.1f} ms"
        )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench trace_picture", description=__doc__)
    parser.add_argument("--quotes", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "trace.png")
    args = parser.parse_args(argv)
    spans, effects = collect(args.quotes)
    draw(spans, effects, args.out)
    return 0
