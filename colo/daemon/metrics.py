"""Prometheus metrics, opt-in (`metrics_listen = "127.0.0.1:9400"` in colo.toml), for the
dashboards admins of GPU servers already run beside DCGM's exporter.

Owns: the last snapshot of the figures. It is built on the event loop after each tick (the
parts' state is the loop's) and swapped in whole; the HTTP thread of prometheus_client only
reads the snapshot, so a scrape never walks state the loop is changing and never waits on it.
Figures from ended jobs (GPU-hours, waits, what sharing saved) are added up by the store at
most every REPORT_EVERY seconds. Metric names: `colo_` + what, units in the name (Prometheus'
conventions); `packaging/grafana-colo.json` is a dashboard of them.
"""
from __future__ import annotations

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

log = logging.getLogger("colo")
REPORT_EVERY = 60.0  # seconds between sums over ended jobs (SQL over the whole history) ...
REPORT_SOONEST = 5.0  # ... or this soon after a job ended


def parse_listen(text: str) -> tuple[str, int]:
    """"127.0.0.1:9400" or ":9400" (every address) -> (address, port); Config.load checked it."""
    host, _, port = str(text).rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


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

    def job_changed(self, prev, job) -> None:
        """The table's on_change (wired in core.open())."""
        if job.state in TERMINAL:
            self._ended = True

    def serve(self) -> None:
        """Start the HTTP endpoint (its own thread, prometheus_client's)."""
        from prometheus_client import CollectorRegistry, start_http_server

        addr, port = parse_listen(self.config.metrics_listen)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        self._server, _ = start_http_server(port, addr, registry=registry)
        log.info("metrics on http://%s:%d/metrics", addr, port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None

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
            gib[j.user] += j.spec.gpu_mem * len(j.gpus)
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
        hours = CounterMetricFamily("colo_user_gpu_hours", "GPU-hours of the user's ended jobs (one per GPU held)",
                                    labels=["user"])
        for u in rep["users"]:
            hours.add_metric([u["user"]], u["gpu_hours"])
        fams.append(hours)
        gauge("colo_user_wait_median_seconds", "median wait of the user's ended jobs", ["user"],
              [((u["user"],), u["wait_median"] or 0.0) for u in rep["users"]])
        for name, doc, key in (("colo_gpu_hours_one_per_gpu", "GPU-hours ended jobs would take, one job per GPU",
                                 "gpu_hours_one_per_gpu"),
                                ("colo_gpu_hours_busy", "GPU-hours the GPUs were busy with them", "gpu_hours_busy"),
                                ("colo_gpu_hours_saved", "GPU-hours sharing saved against one job per GPU",
                                 "gpu_hours_saved")):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], rep[key])
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
