"""Prometheus metrics, opt-in (`metrics_listen = "127.0.0.1:9824"` in colo.toml), for the
dashboards admins of GPU servers already run beside DCGM's exporter (9400: not that port).

Owns: the last snapshot of the figures, and the counters. The snapshot is built on the event loop
after each tick (the parts' state is the loop's) and swapped in whole. The endpoint is served on
the loop too (no thread per connection): at most MAX_CONNECTIONS waiting for their request at
once (a new one makes the longest-waiting go), each given REQUEST_TIMEOUT seconds to ask and to be
answered. A port that cannot be had (taken, no such
address) costs the metrics only: logged once, tried again every RETRY_EVERY seconds.

The counters (`*_seconds_total`) only go up: GPU-seconds are added each tick for the jobs running
then, kept in the store (flushed every FLUSH_EVERY seconds and at the stop), never summed from the
ended jobs retention keeps. The time the daemon is down while jobs run on is not counted.
Metric names: `colo_` + what, units in the name (Prometheus' conventions);
`packaging/grafana-colo.json` is a dashboard of them.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict

from .. import report
from ..config import Config
from ..jobs import ACTIVE, TERMINAL, State
from .gpus import Gpus
from .jobtable import JobTable
from .patrol import Patrol
from .sampler import Sampler
from .suspend import off_gpu, releases_budget

log = logging.getLogger("colo")
REPORT_EVERY = 60.0  # seconds between sums over ended jobs (SQL over the whole history) ...
REPORT_SOONEST = 5.0  # ... or this soon after a job ended
RETRY_EVERY = 10.0  # seconds between tries of a port that could not be had
MAX_CONNECTIONS = 256  # connections waiting for their request (an asyncio task each, no thread)
REQUEST_TIMEOUT = 10.0  # seconds a connection has to send its request, and to take the answer
MAX_REQUEST = 8192  # bytes of request line and headers
FLUSH_EVERY = 30.0  # seconds between writes of the counters to the store
EVERY_ADDRESS = ("0.0.0.0", "::")


def parse_listen(text: str) -> tuple[str, int]:
    """"127.0.0.1:9824", "0.0.0.0:9824", "[::1]:9824" -> (address, port); Config.load checked it."""
    host, _, port = str(text).rpartition(":")
    return host.strip("[]"), int(port)


class Metrics:
    def __init__(self, config: Config, table: JobTable, gpus: Gpus, sampler: Sampler, patrol: Patrol,
                 suspended=None):
        self.config = config
        self.table = table
        self.gpus = gpus
        self.sampler = sampler
        self.patrol = patrol
        self._suspended = suspended  # () -> Suspender.figures(): colo suspend's bytes and counts
        self._families: list = []
        self._report: dict | None = None
        self._report_at = -REPORT_EVERY
        self._ended = True  # a job ended since the last sums
        self._server = None
        self._listener: asyncio.Task | None = None
        # connections that have not sent their request yet, oldest first: a scrape is never kept
        # out by idle ones, which make room for it
        self._waiting: dict = {}
        self.error: str | None = None  # why the endpoint is not up (None: it is, or is about to be)
        self._totals: dict[tuple[str, str], float] = defaultdict(float, table.store.counters())
        self._pending: dict[tuple[str, str], float] = defaultdict(float)
        self._counted_at: float | None = None
        self._flushed_at = time.monotonic()

    def job_changed(self, prev, job) -> None:
        """The table's on_change (wired in core.open())."""
        if job.state in TERMINAL:
            self._ended = True

    def serve(self) -> None:
        """Listen on the loop (from now on, and again until the port can be had)."""
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._listener = asyncio.get_running_loop().create_task(self._listen())

    async def _listen(self) -> None:
        addr, port = parse_listen(self.config.metrics_listen)
        failed = False
        while True:
            try:
                self._server = await asyncio.start_server(self._handle, addr, port, limit=MAX_REQUEST,
                                                          reuse_address=True)
                break
            except OSError as e:
                self.error = f"cannot listen on {self.config.metrics_listen}: {e.strerror or e}"
                if not failed:  # once: a port taken for days must not fill the journal
                    log.error("metrics: %s; the daemon serves on without them and tries again every %.0f s",
                              self.error, RETRY_EVERY)
                    failed = True
            await asyncio.sleep(RETRY_EVERY)
        self.error = None
        log.log(logging.WARNING if failed else logging.INFO, "metrics on http://%s/metrics",
                self.config.metrics_listen)
        if addr in EVERY_ADDRESS:
            log.warning("metrics on every address (%s), without authentication: whoever reaches this node reads "
                        "users' names and jobs", self.config.metrics_listen)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One scrape: GET /metrics, answered and closed (no keep-alive: nothing is held between)."""
        from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

        if len(self._waiting) >= MAX_CONNECTIONS:  # make room: the one that has waited longest goes
            oldest = next(iter(self._waiting))
            del self._waiting[oldest]
            oldest.transport.abort()
        self._waiting[writer] = None
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT)
            self._waiting.pop(writer, None)
            method, target = (head.split(b"\r\n", 1)[0].split(b" ") + [b"", b""])[:2]
            if method not in (b"GET", b"HEAD"):
                status, body, ctype = b"405 Method Not Allowed", b"GET only\n", b"text/plain"
            elif target.split(b"?")[0] not in (b"/metrics", b"/"):
                status, body, ctype = b"404 Not Found", b"see /metrics\n", b"text/plain"
            else:
                status, body, ctype = b"200 OK", generate_latest(self.registry), CONTENT_TYPE_LATEST.encode()
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype + b"\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n"
                         + (body if method != b"HEAD" else b""))
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass  # a slow, silent or oversized client: dropped
        finally:
            self._waiting.pop(writer, None)
            writer.transport.abort()

    def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            self._listener = None
        if self._server is not None:
            self._server.close()
            self._server = None
        self._flush()

    def _flush(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, defaultdict(float)
            try:
                self.table.store.add_counters(pending)
            except Exception as e:  # noqa: BLE001 - kept for the next flush
                for k, v in pending.items():
                    self._pending[k] += v
                log.warning("metrics: storing the counters failed: %s", e)
        self._flushed_at = time.monotonic()

    def _count(self, active) -> None:
        """Add the GPU-seconds since the last tick: per user (one per GPU held), one job per GPU,
        and the GPUs' busy time (at least one job on it); saved = their difference, never < 0."""
        now = time.monotonic()
        dt, self._counted_at = (now - self._counted_at if self._counted_at is not None else 0.0), now
        if dt <= 0:
            return
        per_gpu = 0
        busy: set[str] = set()
        for j in active:
            if j.state == State.RUNNING and j.gpus and not off_gpu(j):  # suspended: nothing on its GPUs
                self._add(("colo_user_gpu_seconds", j.user), len(j.gpus) * dt)
                per_gpu += len(j.gpus)
                busy.update(j.gpus)
        self._add(("colo_gpu_seconds_one_per_gpu", ""), per_gpu * dt)
        self._add(("colo_gpu_seconds_busy", ""), len(busy) * dt)
        self._add(("colo_gpu_seconds_saved", ""), (per_gpu - len(busy)) * dt)
        if now - self._flushed_at >= FLUSH_EVERY:
            self._flush()

    def _add(self, key: tuple[str, str], value: float) -> None:
        if value > 0:
            self._pending[key] += value
            self._totals[key] += value

    def collect(self):  # prometheus_client's Collector interface (its thread)
        return list(self._families)

    def update(self) -> None:
        """Build the snapshot from the parts' state (on the loop)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        now = time.time()
        fams = []

        def gauge(name: str, doc: str, labels: list[str], rows) -> None:
            g = GaugeMetricFamily(name, doc, labels=labels)
            for key, value in rows:
                g.add_metric(list(key), value)
            fams.append(g)

        active = self.table.jobs_in(*ACTIVE)
        queued = self.table.jobs_in(State.QUEUED)
        views = {v.uuid: v for v in self.gpus.views()}
        states = self.gpus.mps.states()
        gpu_rows = [(str(d.index), d.uuid, d.name) for d in self.gpus.devices]
        budgeted: dict[str, int] = defaultdict(int)
        modes: dict[tuple[str, str], int] = defaultdict(int)
        foreign = {f["gpu"] for f in self.patrol.foreign}
        for j in active:
            shown = self.table.mode_shown(j, foreign) or "timesliced"  # as `colo ls` shows it
            for u in j.gpus:
                budgeted[u] += j.spec.gpu_mem
                modes[(u, shown)] += 1
        devices = self.gpus.devices
        gauge("colo_gpu_memory_total_bytes", "GPU memory (NVML)", ["gpu", "uuid", "name"],
              [(k, d.total) for k, d in zip(gpu_rows, devices)])
        gauge("colo_gpu_memory_usable_bytes", "GPU memory colo may budget (total less reserve)", ["gpu", "uuid"],
              [(k[:2], views[d.uuid].usable) for k, d in zip(gpu_rows, devices) if d.uuid in views])
        gauge("colo_gpu_memory_used_bytes", "GPU memory in use (NVML)", ["gpu", "uuid"],
              [(k[:2], d.used) for k, d in zip(gpu_rows, devices)])
        gauge("colo_gpu_budgeted_bytes", "budgets of the jobs placed on the GPU", ["gpu", "uuid"],
              [(k[:2], budgeted.get(d.uuid, 0)) for k, d in zip(gpu_rows, devices)])
        gauge("colo_gpu_unbudgeted_bytes", "GPU memory held outside any budget (the patrol's last look)",
              ["gpu", "uuid"], [(k[:2], self.gpus.unbudgeted.get(d.uuid, 0)) for k, d in zip(gpu_rows, devices)])
        gauge("colo_gpu_jobs", "jobs placed on the GPU, by mode", ["gpu", "uuid", "mode"],
              [(k[:2] + (m,), modes.get((d.uuid, m), 0)) for k, d in zip(gpu_rows, devices)
               for m in ("mps", "timesliced", "exclusive")])
        gauge("colo_gpu_mps_state", "1 for the state of the GPU's MPS server (off, active, fault...)",
              ["gpu", "uuid", "state"], [(k[:2] + (states.get(d.uuid, "off"),), 1) for k, d in zip(gpu_rows, devices)])
        gauge("colo_gpu_up", "1 while NVML answers for the GPU", ["gpu", "uuid"],
              [(k[:2], 0 if d.error else 1) for k, d in zip(gpu_rows, devices)])
        gauge("colo_gpu_drained", "1 while an admin has the GPU drained (colo drain)", ["gpu", "uuid"],
              [(k[:2], 1 if self.gpus.drained.get(d.uuid) else 0) for k, d in zip(gpu_rows, devices)])

        running: dict[str, int] = defaultdict(int)
        waiting: dict[str, int] = defaultdict(int)
        gib: dict[str, int] = defaultdict(int)
        idle: dict[str, int] = defaultdict(int)
        stats = self.sampler.stats
        for j in active:
            running[j.user] += 1
            gib[j.user] += 0 if releases_budget(j) else j.spec.gpu_mem * len(j.gpus)
            st = stats.get(j.id)
            if j.gpus and st is not None and not st.get("sm_util"):  # held, no GPU activity in the last sample
                idle[j.user] += st.get("used") or 0
        for j in queued:
            waiting[j.user] += 1
        gauge("colo_user_jobs", "jobs per user and state", ["user", "state"],
              [((u, "running"), n) for u, n in sorted(running.items())]
              + [((u, "queued"), n) for u, n in sorted(waiting.items())])
        gauge("colo_user_budgeted_bytes", "GPU memory budgeted to the user's running jobs", ["user"],
              [((u,), n) for u, n in sorted(gib.items())])
        gauge("colo_user_idle_bytes", "GPU memory the user's jobs hold with no GPU activity (last sample)",
              ["user"], [((u,), n) for u, n in sorted(idle.items())])
        gauge("colo_queue_jobs", "jobs waiting in the queue", [], [((), len(queued))])
        gauge("colo_queue_oldest_wait_seconds", "how long the longest-waiting queued job has waited", [],
              [((), max((now - j.submitted_at for j in queued), default=0.0))])
        gauge("colo_jobs_over_budget", "running jobs whose processes hold more than their budget (NVML)", [],
              [((), len(self.patrol.over))])

        since = time.monotonic() - self._report_at
        if since >= REPORT_EVERY or (self._ended and since >= REPORT_SOONEST):
            self._ended = False
            try:
                store = self.table.store
                self._report = report.assemble(store.report_users(TERMINAL), store.report_spans(TERMINAL))
            except Exception as e:  # noqa: BLE001 - the live figures are still worth serving
                log.warning("metrics: summing ended jobs failed: %s", e)
            self._report_at = time.monotonic()
        rep = self._report or report.assemble([], [])
        gauge("colo_user_wait_median_seconds", "median wait of the user's ended jobs", ["user"],
              [((u["user"],), u["wait_median"] or 0.0) for u in rep["users"]])
        self._count(active)
        totals = self._totals
        user_s = CounterMetricFamily("colo_user_gpu_seconds", "GPU-seconds of the user's jobs while they ran "
                                     "(one per GPU held; suspended time not counted)", labels=["user"])
        for (name, user), v in sorted(totals.items()):
            if name == "colo_user_gpu_seconds":
                user_s.add_metric([user], v)
        fams.append(user_s)
        for name, doc in (("colo_gpu_seconds_one_per_gpu", "GPU-seconds the jobs would take, one job per GPU"),
                          ("colo_gpu_seconds_busy", "GPU-seconds the GPUs were busy (at least one job on them)"),
                          ("colo_gpu_seconds_saved", "GPU-seconds sharing saved against one job per GPU")):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], totals.get((name, ""), 0.0))
            fams.append(c)
        if self._suspended is not None:
            per_gpu, counts = self._suspended()
            gauge("colo_gpu_suspended_bytes", "GPU memory of suspended jobs, held in host memory (colo suspend)",
                  ["gpu", "uuid"], [(k[:2], per_gpu.get(d.uuid, 0)) for k, d in zip(gpu_rows, devices)])
            for name, doc, key in (("colo_suspends", "jobs suspended (colo suspend, its policies)", "suspends"),
                                   ("colo_resumes", "suspended jobs restored", "resumes"),
                                   ("colo_suspends_refused", "suspends refused (host memory, the driver)", "refused"),
                                   ("colo_suspend_seconds", "time the driver took to suspend", "suspend_seconds"),
                                   ("colo_resume_seconds", "time the driver took to restore", "resume_seconds")):
                c = CounterMetricFamily(name, doc)
                c.add_metric([], counts[key])
                fams.append(c)
        self._families = fams  # swapped whole: a scrape sees this snapshot or the last
