"""The durable job store: leases fenced by epochs, waiting states, timers, tenant fairness;
the workers that run jobs, and operation intents with receipts for external effects."""
