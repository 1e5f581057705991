"""The durable state: jobs, their events and decisions, usage samples. The only module with SQL.

SQLite in WAL mode: every state change is one transaction, so a daemon killed at any moment
leaves each job in exactly one state, with the event that put it there.
"""
from __future__ import annotations

from .accounting import Accounting
from .adminlog import AdminLog
from .base import NotFound, StoreError, StoreFull
from .cleaning import Cleaning
from .drains import Drains
from .jobs import Jobs
from .learning import Learning
from .schema import MIGRATIONS

__all__ = ["MIGRATIONS", "NotFound", "Store", "StoreError", "StoreFull"]


class Store(Jobs, Accounting, Cleaning, Learning, Drains, AdminLog):
    """The store: one class over one connection, its methods by table family (the modules here)."""
