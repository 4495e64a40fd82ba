"""The relay: republishes committed outbox events to Redis Streams.

    from relay import Relay, RelayConfig, RedisStreamPublisher

    publisher = RedisStreamPublisher(redis_client, stream_template="outbox.{topic}")
    relay = Relay(outbox, publisher, RelayConfig(batch_size=500), hooks=hooks)
    relay.run_once()     # one claim-publish-record cycle; how many it published
    relay.run()          # until SIGTERM/SIGINT or relay.stop() (or run(stop=event))

How replicas share the work and keep per-key order: docs/explanation/claims-and-order.md.
"""

from outbox.lifecycle import GracefulStop
from relay.admin import RequeueResult, requeue, status
from relay.config import RelayConfig
from relay.errors import ConfigError, PermanentPublishError, RelayError, RoutingError
from relay.publisher import RedisStreamPublisher, StreamTemplate, TransientError
from relay.records import Orphan, Record
from relay.relay import Relay, RelayStats

__all__ = [
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
    "requeue",
    "status",
]
