"""The relay: republishes committed outbox events to Redis Streams."""
