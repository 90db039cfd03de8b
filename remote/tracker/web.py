"""The farm page and its metrics: ``tether tracker --http PORT``.

- ``/``: a page of the pool that updates itself every second: boards (key,
  state, holder and since when, capabilities), the queue in the order it will
  be served, recent sessions and evictions, and latency plots of the
  ``tether bench`` results posted to the tracker, per model and board over time.
- ``/api/summary``: the same as JSON.
- ``/metrics``: Prometheus text, made with the prometheus_client library:
  boards by key and state, queue length, lease wait and session length
  histograms, evictions and sessions.
- ``/api/history``: per model, key and board, the median of every recorded
  benchmark over time, with the runs slower than the one before beyond 5 %
  (remote/regression.py) marked; from the farm database, so it outlives the
  tracker (without a database: the reports posted since it started).
- ``POST /api/bench``: a ``tether bench --json`` report (``tether bench --post URL``),
  recorded in the farm database when the tracker keeps one.

Host side only; it reads the tracker's state and never changes it.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("tether.tracker")

MAX_POST_BYTES = 4 << 20
# The page draws at most this many of the newest recorded benchmarks.
HISTORY_ROWS = 2000


class History:
    """The page's plots as data, worked out again only when a record was added
    (marking regressions compares every run with the one before it)."""

    def __init__(self, service):
        self._service = service
        self._lock = threading.Lock()
        self._seen = None
        self._data: dict = {}

    def data(self) -> dict:
        db = self._service.db
        if db is None:
            return {"database": None, "series": posted_series(self._service.log.snapshot())}
        with self._lock:
            latest = db.latest_id("bench")
            if latest != self._seen:
                self._data = {"database": db.shown,
                              "series": recorded_series(db.records("bench",
                                                                   limit=HISTORY_ROWS))}
                self._seen = latest
            return self._data


def recorded_series(records: list) -> list:
    """Per model, key and board: [time, median ms, record id, regression ratio or None]."""
    from remote.regression import mark_regressions

    groups: dict = {}
    for r in records:
        groups.setdefault((r["model_name"], r["key"]), []).append(r)
    series = []
    for (model, key), rows in sorted(groups.items()):
        marks = mark_regressions(rows)
        for board in sorted({r["device_id"] for r in rows}):
            series.append({"model": model, "key": key, "board": board, "points": [
                [r["recorded_at"], r["median_s"] * 1e3, r["id"],
                 marks[r["id"]]["ratio"] if r["id"] in marks else None]
                for r in rows if r["device_id"] == board]})
    return series


def posted_series(snapshot: dict) -> list:
    """The same from reports posted to a tracker without a database (medians only)."""
    by: dict = {}
    for posted in snapshot["bench"]:
        report = posted["report"]
        model = str((report.get("model") or {}).get("path") or "model").rsplit("/", 1)[-1]
        for r in report.get("results") or []:
            median = (r.get("stats_s") or {}).get("median")
            if median is not None:
                key = (model, str(r.get("key", "?")), str(r.get("device_id", "")))
                by.setdefault(key, []).append([posted["time"], median * 1e3, None, None])
    return [{"model": m, "key": k, "board": b, "points": points}
            for (m, k, b), points in sorted(by.items())]


def pool(service) -> dict:
    """The pool as plain data, as ``tether status --json`` shows it."""
    from remote.client.session import device_info_dict

    reply = service.summary_reply()
    now = time.time()
    devices = [{"device_id": d.device_id, "key": d.key, "address": d.address, "state": d.state,
                "holder": d.holder, "held_s": d.held_s,
                "held_since": now - d.held_s if d.holder else None,
                "last_seen_s": d.last_seen_s, "relayed": d.relayed, **device_info_dict(d.info)}
               for d in reply.devices]
    return {"devices": devices,
            "keys": [{"key": k.key, "total": k.total, "free": k.free, "pending": k.pending}
                     for k in reply.keys],
            "waiting": [{"key": w.key, "priority": w.priority, "client": w.client,
                         "waited_s": w.waited_s} for w in reply.waiting]}


def metrics_text(service, data: dict) -> bytes:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                        HistogramMetricFamily)

    farm = service.log

    class Farm:
        def collect(self):
            boards = GaugeMetricFamily("tether_boards", "Boards registered, by key and state",
                                       labels=["key", "state"])
            counts = {}
            for d in data["devices"]:
                counts[(d["key"], d["state"])] = counts.get((d["key"], d["state"]), 0) + 1
            for key in {k["key"] for k in data["keys"]}:
                for state in ("free", "leased", "in_use"):
                    boards.add_metric([key, state], counts.get((key, state), 0))
            yield boards
            queue = GaugeMetricFamily("tether_queue_length", "Requests waiting for a board",
                                      labels=["key"])
            for k in data["keys"]:
                queue.add_metric([k["key"]], k["pending"])
            yield queue
            for name, text, table in (
                    ("tether_lease_wait_seconds", "Time from request to lease", farm.lease_wait),
                    ("tether_session_seconds", "Time a lease was held", farm.session_length)):
                family = HistogramMetricFamily(name, text, labels=["key"])
                for key, histogram in sorted(table.items()):
                    family.add_metric([key], histogram.cumulative(), histogram.total)
                yield family
            for name, text, table in (
                    ("tether_sessions", "Leases ended", farm.sessions_total),
                    ("tether_evictions", "Boards dropped: silent or link closed",
                     farm.evictions_total)):
                family = CounterMetricFamily(name, text, labels=["key"])
                for key, count in sorted(table.items()):
                    family.add_metric([key], count)
                yield family

    registry = CollectorRegistry()
    registry.register(Farm())
    return generate_latest(registry)


class FarmPage:
    """The HTTP server, in its own threads."""

    def __init__(self, service, host: str, port: int):
        page = self
        history = History(service)

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt, *args):  # the tracker's log, not stderr lines
                log.debug("http: " + fmt, *args)

            def _send(self, code: int, body: bytes, kind: str):
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                path = self.path.split("?", 1)[0]
                if path == "/":
                    self._send(200, PAGE.encode(), "text/html; charset=utf-8")
                elif path == "/api/summary":
                    data = {**pool(service), **service.log.snapshot(), "now": time.time()}
                    self._send(200, json.dumps(data).encode(), "application/json")
                elif path == "/api/history":
                    try:
                        data = history.data()
                    except Exception as exc:  # noqa: BLE001 - a database that went away
                        self._send(503, f"the farm database could not be read: {exc}\n"
                                   .encode(), "text/plain")
                        return
                    self._send(200, json.dumps(data).encode(), "application/json")
                elif path == "/metrics":
                    from prometheus_client import CONTENT_TYPE_LATEST
                    self._send(200, metrics_text(service, pool(service)), CONTENT_TYPE_LATEST)
                else:
                    self._send(404, b"not found: try / , /api/summary, /api/history or /metrics\n",
                               "text/plain")

            def do_POST(self):
                if self.path != "/api/bench":
                    self._send(404, b"POST goes to /api/bench\n", "text/plain")
                    return
                length = int(self.headers.get("Content-Length") or 0)
                if not 0 < length <= MAX_POST_BYTES:
                    self._send(413, f"a report of 1 to {MAX_POST_BYTES} bytes, please\n".encode(),
                               "text/plain")
                    return
                try:
                    report = json.loads(self.rfile.read(length))
                    if not isinstance(report.get("results"), list):
                        raise ValueError("no results list")
                except (ValueError, AttributeError) as exc:
                    self._send(400, f"not a tether bench --json report: {exc}\n".encode(),
                               "text/plain")
                    return
                if service.db is not None:
                    from remote.errors import InvalidArgument
                    labels = report.get("labels") or {}
                    try:
                        if not isinstance(labels, dict):
                            raise InvalidArgument("labels must be an object of names to values")
                        ids = service.db.record("bench", report,
                                                {str(k): str(v) for k, v in labels.items()},
                                                "farm page")
                    except InvalidArgument as exc:
                        self._send(400, f"{exc}\n".encode(), "text/plain")
                        return
                    self._send(200, json.dumps({"ok": True, "record_ids": ids}).encode(),
                               "application/json")
                    return
                service.log.add_bench(report)
                self._send(200, b'{"ok": true}', "application/json")

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="farm-page",
                                        daemon=True)
        self._thread.start()
        page.url = f"http://{host}:{self.port}/"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>Tether farm</title>
<style>
 body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
 table { border-collapse: collapse; margin: .5em 0 1.5em; }
 th, td { padding: .25em .7em; border-bottom: 1px solid #ddd; text-align: left; }
 th { background: #f3f3f3; }
 .free { color: #17803d; } .leased { color: #b26b00; } .in_use { color: #b3261e; }
 .muted { color: #777; } h2 { margin-bottom: .2em; }
 svg { background: #fafafa; border: 1px solid #ddd; margin: .3em 1em .8em 0; }
</style></head>
<body>
<h1>Tether farm <span id="updated" class="muted" data-updates="0"></span></h1>
<h2>Boards</h2><table id="boards"><thead><tr><th>device</th><th>key</th><th>address</th>
<th>state</th><th>holder</th><th>since</th><th>triple</th><th>cpu</th><th>cores</th></tr></thead>
<tbody></tbody></table>
<h2>Queue</h2><table id="queue"><thead><tr><th>#</th><th>key</th><th>priority</th>
<th>client</th><th>waited</th></tr></thead><tbody></tbody></table>
<h2>Recent sessions</h2><table id="sessions"><thead><tr><th>ended</th><th>key</th>
<th>device</th><th>holder</th><th>held</th><th>how</th></tr></thead><tbody></tbody></table>
<h2>Events</h2><table id="events"><thead><tr><th>when</th><th>what</th><th></th></tr></thead>
<tbody></tbody></table>
<h2>Benchmarks <span id="database" class="muted"></span></h2><div id="bench">
<p class="muted">none recorded yet (tether bench ... --key KEY records every run)</p></div>
<script>
function esc(s) { return String(s).replace(/[&<>"]/g, c => ({"&": "&amp;", "<": "&lt;",
  ">": "&gt;", '"': "&quot;"}[c])); }
function dur(s) { return s < 1 ? (s * 1000).toFixed(1) + " ms" : s < 120 ? s.toFixed(1) + " s"
  : (s / 60).toFixed(1) + " min"; }
function when(t) { return new Date(t * 1000).toLocaleTimeString(); }
function fill(id, rows) {
  document.querySelector("#" + id + " tbody").innerHTML = rows.map(r => "<tr>" + r.map(
    c => "<td>" + c + "</td>").join("") + "</tr>").join("");
}
function plot(name, runs) {
  // One line per board: median latency (ms) of each recorded run, in time order;
  // a run slower than the one before it beyond 5 % is ringed in red.
  const w = 420, h = 160, pad = 30;
  const all = runs.flatMap(r => r.points);
  if (!all.length) return "";
  const t0 = Math.min(...all.map(p => p[0])), t1 = Math.max(...all.map(p => p[0])) || t0 + 1;
  const v1 = Math.max(...all.map(p => p[1])) * 1.1 || 1;
  const x = t => pad + (w - 2 * pad) * (t1 > t0 ? (t - t0) / (t1 - t0) : 0.5);
  const y = v => h - pad - (h - 2 * pad) * v / v1;
  const colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"];
  const lines = runs.map((r, i) => '<polyline class="series" fill="none" stroke="'
    + colors[i % colors.length] + '" stroke-width="2" points="'
    + r.points.map(p => x(p[0]).toFixed(1) + "," + y(p[1]).toFixed(1)).join(" ") + '"/>'
    + r.points.map(p => '<circle r="3" fill="' + colors[i % colors.length] + '" cx="'
      + x(p[0]).toFixed(1) + '" cy="' + y(p[1]).toFixed(1) + '"><title>' + esc(r.board) + ": "
      + p[1].toFixed(3) + ' ms</title></circle>'
      + (p[3] == null ? "" : '<circle class="regression" r="7" fill="none" stroke="red" '
        + 'stroke-width="2" cx="' + x(p[0]).toFixed(1) + '" cy="' + y(p[1]).toFixed(1)
        + '"><title>regression: ' + p[3].toFixed(3) + 'x the run before</title></circle>'))
      .join("")).join("");
  return '<svg class="plot" data-model="' + esc(name) + '" width="' + w + '" height="' + h
    + '"><text x="' + pad + '" y="16">' + esc(name) + " — median ms, " + v1.toFixed(2)
    + ' max</text>' + lines + "</svg>";
}
function benchPlots(series) {
  const by = {};
  for (const s of series) (by[s.model + " on " + s.key] = by[s.model + " on " + s.key] || [])
    .push({board: s.board, points: s.points});
  return Object.keys(by).map(name => plot(name, by[name])).join("");
}
async function refresh() {
  try {
    const r = await fetch("/api/summary", {cache: "no-store"}), d = await r.json();
    fill("boards", d.devices.map(b => [esc(b.device_id), esc(b.key),
      esc(b.address || "") + (b.relayed ? " (relay)" : ""),
      '<span class="' + b.state + '">' + b.state + "</span>", esc(b.holder || "-"),
      b.held_since ? when(b.held_since) : "-", esc(b.triple), esc(b.cpu_model), b.cores]));
    fill("queue", d.waiting.map((w, i) => [i + 1, esc(w.key), w.priority, esc(w.client),
      dur(w.waited_s)]));
    fill("sessions", d.sessions.slice().reverse().slice(0, 20).map(s => [when(s.time),
      esc(s.key), esc(s.device_id), esc(s.holder), dur(s.held_s), esc(s.how)]));
    fill("events", d.events.slice().reverse().slice(0, 30).map(e => [when(e.time),
      esc(e.kind), esc(e.text)]));
    const h = await (await fetch("/api/history", {cache: "no-store"})).json();
    if (h.series.length) document.getElementById("bench").innerHTML = benchPlots(h.series);
    document.getElementById("database").textContent = h.database ? "(kept in "
      + h.database + ")" : "(posted since the tracker started; it keeps no database)";
    const u = document.getElementById("updated");
    u.dataset.updates = String(Number(u.dataset.updates) + 1);
    u.textContent = "updated " + when(d.now);
  } catch (e) {
    document.getElementById("updated").textContent = "tracker unreachable: " + e;
  }
}
refresh();
setInterval(refresh, 1000);
</script>
</body></html>
"""
