"""Quota groups: API keys stored hashed (keys.py) and the usage ledger a centre bills from (ledger.py)."""
