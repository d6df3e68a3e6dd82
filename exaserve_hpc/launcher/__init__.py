"""Only ``python -m exaserve_hpc.launcher``, the per-rank command job scripts run; what a rank does is in
app/rank.py."""
