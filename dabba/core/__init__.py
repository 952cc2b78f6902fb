"""Bookkeeping of requests, KV blocks and scheduling. Pure Python: no torch import here."""
