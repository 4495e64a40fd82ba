"""Prometheus metrics, the exporter and the alert rules of the toolkit."""
