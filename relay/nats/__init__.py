"""The NATS JetStream broker: :class:`~relay.nats.broker.NatsBroker` is the
:class:`relay.broker.Broker`; :mod:`relay.nats.client` drives nats-py's asyncio connection
from threads, :mod:`relay.nats.names` maps outbox names to NATS ones and
:mod:`relay.nats.health` checks the streams for lost messages. Needs ``nats-py``
(``pip install 'outbox-toolkit[nats]'``)."""
