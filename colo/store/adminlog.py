"""The log of admin actions (`colo history --admin`): who did what, when, to what, and why."""
from __future__ import annotations

import time

from .base import Base

ADMIN_LOG_KEEP = 10_000  # actions kept: the newest; older ones go as new ones are written


class AdminLog(Base):
    # admin actions (colo history --admin) --------------------------------------------------------
    def log_admin(self, by: str, action: str, target: str, why: str = "", now: float | None = None) -> None:
        """One action, and the log held to its newest ADMIN_LOG_KEEP (ids only grow: one indexed delete)."""
        with self.tx():
            cur = self.db.execute("INSERT INTO admin_log(at, by, action, target, why) VALUES (?,?,?,?,?)",
                                  (time.time() if now is None else now, by, action, target, why))
            self.db.execute("DELETE FROM admin_log WHERE id <= ?", (cur.lastrowid - ADMIN_LOG_KEEP,))

    def admin_log(self, since: float | None = None, limit: int | None = None) -> tuple[list[dict], int]:
        """The actions at or after `since`, newest first, at most `limit`; and how many more matched."""
        where, args = ("WHERE at >= ?", [since]) if since is not None else ("", [])
        rows = [dict(at=r[0], by=r[1], action=r[2], target=r[3], why=r[4]) for r in self.db.execute(
            f"SELECT at, by, action, target, why FROM admin_log {where} ORDER BY id DESC"
            + (" LIMIT ?" if limit else ""), [*args, *([limit] if limit else [])])]
        left = 0
        if limit and len(rows) == limit:
            left = self.db.execute(f"SELECT count(*) FROM admin_log {where}", args).fetchone()[0] - limit
        return rows, left
