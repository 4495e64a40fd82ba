"""The NATS JetStream broker: :class:`~relay.nats.broker.NatsBroker` is the
:class:`relay.broker.Broker`; :mod:`outbox.nats_client` (shared with the consumer) drives
nats-py's asyncio connection from threads and maps outbox names to NATS ones;
:mod:`relay.nats.health` checks the streams for lost messages. Needs ``nats-py``
(``pip install 'outbox-toolkit[nats]'``)."""
