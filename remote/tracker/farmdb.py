"""The farm database: every benchmark, accuracy check and session, kept.

One schema (the tables below, built by the Alembic revisions in
``remote/tracker/migrations``) in SQLite by default, a file in the tracker's
state folder, or PostgreSQL for a team (``tether tracker --db
postgresql://user@host/farm``), spoken through SQLAlchemy Core. Opening a
database runs the revisions it lacks, so an upgraded tracker opens an old
database and keeps every record.

Writes go through one writer thread: the lease path only puts a session on
its queue, and a recorded report waits for its own write alone. Reads
(``tether history``, the farm page) use their own connections.

    >>> db = FarmDatabase("sqlite:////tmp/farm.sqlite")          # doctest: +SKIP
    >>> db.record("bench", report, {"commit": "abc123"}, "alice")  # doctest: +SKIP
    [1]
"""
from __future__ import annotations

import json
import logging
import math
import os
import queue
import statistics
import threading
import time
from concurrent.futures import Future
from typing import Callable, Dict, List, Optional

import sqlalchemy as sa

from remote.errors import InvalidArgument

log = logging.getLogger("tether.tracker")

MIGRATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "migrations")
KINDS = ("bench", "check")
# Writes queued together go in one transaction, at most this many.
WRITE_BATCH = 500
# The most records one query returns (the newest ones).
MAX_ROWS = 10000

metadata = sa.MetaData()

_RUN_COLUMNS = (
    ("recorded_at", sa.Float), ("created", sa.String(40)), ("model_name", sa.String(255)),
    ("model_sha256", sa.String(64)), ("module_sha256", sa.String(64)), ("target", sa.Text),
    ("compiler_version", sa.String(100)), ("device_id", sa.String(255)),
    ("key", sa.String(255)), ("device", sa.Text))

benchmarks = sa.Table(
    "benchmarks", metadata, sa.Column("id", sa.Integer, primary_key=True),
    *(sa.Column(name, kind) for name, kind in _RUN_COLUMNS),
    sa.Column("conditions", sa.Text), sa.Column("samples_s", sa.Text),
    sa.Column("median_s", sa.Float), sa.Column("holder", sa.String(255)),
    # What the regression gate found (--baseline / --baseline-module), or NULL.
    sa.Column("comparison", sa.Text))

checks = sa.Table(
    "checks", metadata, sa.Column("id", sa.Integer, primary_key=True),
    *(sa.Column(name, kind) for name, kind in _RUN_COLUMNS),
    sa.Column("reference", sa.String(255)), sa.Column("inputs", sa.Text),
    sa.Column("tolerances", sa.Text), sa.Column("outputs", sa.Text),
    sa.Column("passed", sa.Boolean), sa.Column("holder", sa.String(255)))

sessions = sa.Table(
    "sessions", metadata, sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("key", sa.String(255)), sa.Column("device_id", sa.String(255)),
    sa.Column("holder", sa.String(255)), sa.Column("started_at", sa.Float),
    sa.Column("ended_at", sa.Float), sa.Column("how", sa.String(255)))

labels = sa.Table(
    "labels", metadata, sa.Column("kind", sa.String(16)), sa.Column("record_id", sa.Integer),
    sa.Column("name", sa.String(255)), sa.Column("value", sa.String(1000)))

TABLES = {"bench": benchmarks, "check": checks}
# Columns kept as JSON text.
JSON_COLUMNS = {"target", "device", "conditions", "samples_s", "inputs", "tolerances", "outputs",
                "comparison"}


def shown_url(url: str) -> str:
    """The URL as logs and replies may show it: no password."""
    try:
        return sa.engine.make_url(url).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return url


def _engine(url: str) -> sa.engine.Engine:
    try:
        parsed = sa.engine.make_url(url)
    except sa.exc.ArgumentError:
        raise InvalidArgument(
            f"--db {url!r} is not a database URL; give sqlite:///PATH or "
            "postgresql://USER@HOST[:PORT]/NAME") from None
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(parsed.database)), exist_ok=True)
        engine = sa.create_engine(parsed, connect_args={"timeout": 30})

        @sa.event.listens_for(engine, "connect")
        def _wal(dbapi_connection, _record):
            # Readers (the farm page, history) never wait for the writer; in WAL
            # mode NORMAL keeps every commit through a crash of the tracker (not
            # of the machine's power) without an fsync per commit.
            dbapi_connection.execute("PRAGMA journal_mode=WAL")
            dbapi_connection.execute("PRAGMA synchronous=NORMAL")
        return engine
    try:
        return sa.create_engine(parsed, pool_pre_ping=True)
    except ImportError as exc:
        raise InvalidArgument(
            f"--db {shown_url(url)}: its driver is not installed ({exc}); for PostgreSQL "
            "pip install 'tether[postgres]'") from None


def upgrade(engine: sa.engine.Engine, revision: str = "head") -> None:
    """Bring the database's schema to ``revision`` (the newest by default)."""
    from alembic import command
    from alembic.config import Config
    from alembic.util.exc import CommandError

    config = Config()
    config.set_main_option("script_location", MIGRATIONS)
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        try:
            command.upgrade(config, revision)
        except CommandError as exc:
            raise InvalidArgument(
                f"the farm database {shown_url(str(engine.url))} has a schema this tracker "
                f"does not know ({exc}); it was written by a newer Tether: upgrade this "
                "tracker") from None


def schema_revision(engine: sa.engine.Engine) -> Optional[str]:
    from alembic.runtime.migration import MigrationContext
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


# -------------------------------------------------------------- reports --
def _text(value, what: str, limit: int = 255) -> str:
    if value is None:
        return ""
    if not isinstance(value, (str, int, float)):
        raise InvalidArgument(f"the report's {what} is {type(value).__name__}, not text")
    return str(value)[:limit]


def _samples(result: dict, where: str) -> List[float]:
    samples = result.get("samples_s")
    if (not isinstance(samples, list) or not samples
            or not all(isinstance(s, (int, float)) and math.isfinite(s) and s >= 0
                       for s in samples)):
        raise InvalidArgument(f"{where} has no samples_s (a list of per-run seconds); post a "
                              "report written by `tether bench --json`")
    return [float(s) for s in samples]


def _common(report: dict, result: dict, holder: str, now: float) -> dict:
    model = report.get("model") or {}
    if not isinstance(model, dict) or not model.get("path"):
        raise InvalidArgument("the report names no model (model.path); post a report written "
                              "by `tether bench --json` or `tether check --json`")
    if not isinstance(result, dict) or not result.get("key"):
        raise InvalidArgument("a result in the report has no board key")
    tool = report.get("tool") or {}
    return {
        "recorded_at": now, "created": _text(report.get("created"), "created", 40),
        "model_name": _text(os.path.basename(str(model["path"])), "model path"),
        "model_sha256": _text(model.get("sha256"), "model sha256", 64),
        "module_sha256": _text(model.get("module_sha256"), "module sha256", 64),
        "target": json.dumps(report.get("target") or {}),
        "compiler_version": _text(report.get("compiler") or tool.get("version"),
                                  "compiler", 100),
        "device_id": _text(result.get("device_id"), "device id"),
        "key": _text(result["key"], "key"), "device": json.dumps(result.get("device") or {}),
        "holder": _text(holder, "holder"),
    }


def bench_rows(report: dict, holder: str, now: float) -> List[dict]:
    """One benchmarks row per board of a ``tether bench --json`` report."""
    if not isinstance(report, dict) or not isinstance(report.get("results"), list):
        raise InvalidArgument("not a `tether bench --json` report: it has no results list")
    options = report.get("options") or {}
    rows = []
    for n, result in enumerate(report["results"]):
        samples = _samples(result, f"result {n} ({result.get('device_id', '?')})")
        conditions = {name: result.get(name) for name in (
            "number", "repeat", "threads", "cold_load_s", "warm_load_s", "peak_rss_bytes")}
        conditions.update({name: options.get(name) for name in ("min_repeat_ms", "cooldown_ms")})
        conditions["command"] = report.get("command")
        comparison = result.get("baseline")
        if comparison is not None and not isinstance(comparison, dict):
            raise InvalidArgument(f"result {n} ({result.get('device_id', '?')}): its baseline "
                                  "is not a comparison; post a report written by `tether bench "
                                  "--json`")
        rows.append({**_common(report, result, holder, now), "conditions": json.dumps(conditions),
                     "samples_s": json.dumps(samples), "median_s": statistics.median(samples),
                     "comparison": json.dumps(comparison) if comparison else None})
    return rows


def check_rows(report: dict, holder: str, now: float) -> List[dict]:
    """One checks row per board of a ``tether check --json`` report."""
    if not isinstance(report, dict) or not isinstance(report.get("results"), list):
        raise InvalidArgument("not a `tether check --json` report: it has no results list")
    rows = []
    for n, result in enumerate(report["results"]):
        if not isinstance(result.get("outputs"), list) or "passed" not in result:
            raise InvalidArgument(f"result {n} of the check report has no outputs or passed")
        rows.append({**_common(report, result, holder, now),
                     "reference": _text(report.get("reference"), "reference"),
                     "inputs": json.dumps(report.get("inputs") or {}),
                     "tolerances": json.dumps(report.get("tolerances") or {}),
                     "outputs": json.dumps(result["outputs"]), "passed": bool(result["passed"])})
    return rows


ROWS = {"bench": bench_rows, "check": check_rows}


def check_labels(given: Dict[str, str]) -> Dict[str, str]:
    for name, value in given.items():
        if not name or len(name) > 255 or len(value) > 1000:
            raise InvalidArgument(f"label {name!r}={value[:40]!r}: a name of 1 to 255 "
                                  "characters and a value of at most 1000, please")
    return dict(given)


class FarmDatabase:
    """The tracker's database, opened (and brought to the newest schema)."""

    def __init__(self, url: str):
        self.url = url
        self.shown = shown_url(url)
        self.engine = _engine(url)
        try:
            upgrade(self.engine)
        except sa.exc.OperationalError as exc:
            self.engine.dispose()
            raise InvalidArgument(f"cannot open the farm database {self.shown}: "
                                  f"{str(exc.orig).strip()}; check --db") from None
        self._queue: "queue.Queue" = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="farm-db-writer",
                                        daemon=True)
        self._writer.start()

    # ------------------------------------------------------------ writes --
    def _write_loop(self):
        while True:
            batch = [self._queue.get()]
            # What queued up meanwhile goes in the same transaction: one commit
            # (one fsync) for a burst of ended sessions, not one each.
            while len(batch) < WRITE_BATCH and batch[-1] is not None:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = batch[-1] is None
            ended = [item for item in batch if isinstance(item, dict)]
            writes = [item for item in batch if isinstance(item, tuple)]
            try:
                with self.engine.begin() as connection:
                    if ended:  # one executemany for every session that ended meanwhile
                        connection.execute(sessions.insert(), ended)
                    results = [write(connection) for write, _ in writes]
            except Exception as exc:  # noqa: BLE001 - one at a time, so one bad write loses no other
                if ended:
                    log.error("farm database %s: %d ended sessions not kept: %s", self.shown,
                              len(ended), exc)
                for write, done in writes:
                    self._write_one(write, done)
            else:
                for (_, done), result in zip(writes, results):
                    done.set_result(result)
            if stop:
                return

    def _write_one(self, write: Callable, done: Future) -> None:
        try:
            with self.engine.begin() as connection:
                result = write(connection)
        except Exception as exc:  # noqa: BLE001 - logged; the tracker keeps serving
            log.error("farm database %s: a write failed: %s", self.shown, exc)
            done.set_exception(exc)
        else:
            done.set_result(result)

    def _submit(self, write: Callable) -> Future:
        done: Future = Future()
        self._queue.put((write, done))
        return done

    def record_session(self, key: str, device_id: str, holder: str, held_s: float,
                       how: str) -> None:
        """Queue an ended session (no wait: this is on the lease path)."""
        ended = time.time()
        row = {"key": key, "device_id": device_id, "holder": holder[:255],
               "started_at": ended - held_s, "ended_at": ended, "how": how[:255]}
        self._queue.put(row)

    def record(self, kind: str, report: dict, given_labels: Dict[str, str], holder: str,
               timeout: float = 60.0) -> List[int]:
        """Record a report (one row per board) with its labels; the new rows' ids."""
        if kind not in ROWS:
            raise InvalidArgument(f"record kind {kind!r}: one of {', '.join(KINDS)}")
        rows = ROWS[kind](report, holder, time.time())
        given_labels = check_labels(given_labels)
        table = TABLES[kind]

        def write(connection):
            ids = []
            for row in rows:
                # inserted_primary_key, not RETURNING: SQLite has that only since 3.35.
                (record_id,) = connection.execute(table.insert(), row).inserted_primary_key
                ids.append(record_id)
                if given_labels:
                    connection.execute(labels.insert(), [
                        {"kind": kind, "record_id": record_id, "name": n, "value": v}
                        for n, v in given_labels.items()])
            return ids

        return self._submit(write).result(timeout)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued write is done."""
        self._submit(lambda connection: None).result(timeout)

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join(30.0)
        self.engine.dispose()

    # ------------------------------------------------------------- reads --
    def records(self, kind: str, model: str = "", key: str = "",
                with_labels: Optional[Dict[str, str]] = None, limit: int = 0) -> List[dict]:
        """Recorded benchmarks or checks, oldest first (the newest ``limit``).
        ``model`` matches the model's file name or its or its module's sha256."""
        if kind not in TABLES:
            raise InvalidArgument(f"record kind {kind!r}: one of {', '.join(KINDS)}")
        table = TABLES[kind]
        query = sa.select(table)
        if model:
            query = query.where(sa.or_(table.c.model_name == model,
                                       table.c.model_sha256 == model,
                                       table.c.module_sha256 == model))
        if key:
            query = query.where(table.c.key == key)
        for name, value in (with_labels or {}).items():
            query = query.where(table.c.id.in_(
                sa.select(labels.c.record_id).where(labels.c.kind == kind,
                                                    labels.c.name == name,
                                                    labels.c.value == value)))
        limit = min(limit or MAX_ROWS, MAX_ROWS)
        query = query.order_by(table.c.recorded_at.desc(), table.c.id.desc()).limit(limit)
        with self.engine.connect() as connection:
            rows = [dict(r._mapping) for r in connection.execute(query)]
            found = {}
            if rows:
                for r in connection.execute(sa.select(labels).where(
                        labels.c.kind == kind,
                        labels.c.record_id.in_([row["id"] for row in rows]))):
                    found.setdefault(r.record_id, {})[r.name] = r.value
        for row in rows:
            for column in JSON_COLUMNS & set(row):
                row[column] = json.loads(row[column]) if row[column] else None
            row["labels"] = found.get(row["id"], {})
            row["kind"] = kind
        return rows[::-1]

    def latest_id(self, kind: str) -> Optional[int]:
        """The newest record's id (None: none yet): a cheap "has anything changed?"."""
        table = TABLES[kind]
        with self.engine.connect() as connection:
            return connection.execute(sa.select(sa.func.max(table.c.id))).scalar()

    def sessions(self, limit: int = 100) -> List[dict]:
        query = sa.select(sessions).order_by(sessions.c.ended_at.desc()).limit(limit)
        with self.engine.connect() as connection:
            return [dict(r._mapping) for r in connection.execute(query)][::-1]

    def counts(self) -> Dict[str, int]:
        with self.engine.connect() as connection:
            return {name: connection.execute(sa.select(sa.func.count()).select_from(t)).scalar()
                    for name, t in (("bench", benchmarks), ("check", checks),
                                    ("sessions", sessions))}
