"""The Redis broker: Redis Streams on one server or a Redis Cluster.

:class:`~relay.redis.publisher.RedisStreamPublisher` is the :class:`relay.broker.Broker`;
:mod:`relay.redis.cluster` runs its script slot by slot, :mod:`relay.redis.replies` packs
and classifies replies, :mod:`relay.redis.trim` picks each stream's MINID,
:mod:`relay.redis.health` and :mod:`relay.redis.data_loss` check Redis's persistence and the
markers that reveal lost entries.
"""
