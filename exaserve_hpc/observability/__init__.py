"""Observability: the fleet's metrics on /metrics (collector.py over readings.py), local alert checks
and the live status view (watch.py), JSON-lines logs (logs.py). Alert rules and the Grafana dashboard
live in deploy/."""
