"""The drained GPUs (`colo drain`)."""
from __future__ import annotations

import time

from .base import Base


class Drains(Base):
    # drained GPUs (colo drain) ------------------------------------------------------------------
    def drains(self) -> dict[str, dict]:
        """uuid -> {index, by, reason, at} of every drained GPU."""
        return {r[0]: dict(index=r[1], by=r[2], reason=r[3], at=r[4]) for r in self.db.execute(
            "SELECT uuid, gpu_index, by, reason, at FROM drains ORDER BY gpu_index")}

    def set_drain(self, uuid: str, index: int, by: str, reason: str, now: float | None = None) -> None:
        with self.tx():
            self.db.execute("INSERT OR REPLACE INTO drains(uuid, gpu_index, by, reason, at) VALUES (?,?,?,?,?)",
                            (uuid, index, by, reason, time.time() if now is None else now))

    def undrain(self, uuid: str) -> bool:
        """Whether it was drained."""
        with self.tx():
            return self.db.execute("DELETE FROM drains WHERE uuid=?", (uuid,)).rowcount > 0
