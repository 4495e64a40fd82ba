"""The relay: republishes committed outbox events to a broker (Redis Streams, NATS JetStream).

    from relay import Relay, RelayConfig, broker_for

    broker = broker_for("redis://127.0.0.1:6379/0", stream_template="outbox.{topic}")
    relay = Relay(outbox, broker, RelayConfig(batch_size=500), hooks=hooks)
    relay.run_once()     # one claim-publish-record cycle; how many it published
    relay.run()          # until SIGTERM/SIGINT or relay.stop() (or run(stop=event))

How replicas share the work and keep per-key order: docs/explanation/claims-and-order.md.
"""

from outbox.lifecycle import GracefulStop
from relay.admin import RequeueResult, requeue, status
from relay.broker import Broker, broker_for
from relay.config import RelayConfig
from relay.errors import ConfigError, PermanentPublishError, RelayError, RoutingError
from relay.records import Orphan, Record
from relay.redis.publisher import RedisStreamPublisher, StreamTemplate, TransientError
from relay.relay import Relay, RelayStats

__all__ = [
    "Broker",
    "ConfigError",
    "GracefulStop",
    "Orphan",
    "PermanentPublishError",
    "Record",
    "RedisStreamPublisher",
    "Relay",
    "RelayConfig",
    "RelayError",
    "RelayStats",
    "RequeueResult",
    "RoutingError",
    "StreamTemplate",
    "TransientError",
    "broker_for",
    "requeue",
    "status",
]
