"""The farm database behind a real tracker process: SQLite and a real PostgreSQL
server started here; records survive a tracker restart; an old database (the
first schema) is brought up to date by the tracker that opens it."""
import contextlib
import subprocess
import sys

import pytest

from remote.cli.localfarm import LocalFarm
from remote.errors import InvalidArgument, RemoteError
from tests.postgres_server import postgres_server
from tests.test_tracker import HANG_S, child_env

sa = pytest.importorskip("sqlalchemy")
farmdb = pytest.importorskip("remote.tracker.farmdb")


def bench_report(model="squeezenet.onnx", key="k", device_id="k-1", samples=(0.004, 0.005)):
    return {"schema": "tether.bench/1", "created": "2026-11-26T12:00:00+00:00",
            "tool": {"name": "tether", "version": "0.1.0"},
            "model": {"path": f"/models/{model}", "sha256": "aa" * 32,
                      "module_sha256": "bb" * 32},
            "target": {"name": "rasp4b64", "triple": "aarch64-unknown-linux-gnu"},
            "options": {"min_repeat_ms": 0, "cooldown_ms": 0},
            "results": [{"key": key, "device_id": device_id, "device": {"cores": 4},
                         "samples_s": list(samples), "number": 10, "repeat": len(samples),
                         "threads": 4}]}


def check_report(passed=True):
    return {"schema": "tether.check/1", "model": {"path": "/models/squeezenet.onnx"},
            "reference": "onnxruntime 1.16", "inputs": {"count": 2, "source": "random"},
            "tolerances": {"max_abs": 1e-4},
            "results": [{"key": "k", "device_id": "k-1", "passed": passed,
                         "outputs": [{"name": "y", "max_abs": 1e-6, "cosine": 1.0}]}]}


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def new_database(request, tmp_path_factory):
    """A function giving the URL of a fresh database of the backend."""
    if request.param == "sqlite":
        folder = tmp_path_factory.mktemp("farm-db")
        names = iter(range(1000))
        yield lambda: f"sqlite:///{folder}/farm-{next(names)}.sqlite"
    else:
        with postgres_server() as server:
            yield server.new_database


@contextlib.contextmanager
def farm_on(url, keys=("k",)):
    with LocalFarm(keys=list(keys), tracker_args=["--db", url], env=child_env()) as farm:
        yield farm


def test_a_tracker_restart_keeps_every_record(new_database):
    url = new_database()
    with farm_on(url) as farm:
        tracker = farm.client()
        assert farmdb.shown_url(url) in farm.tracker_proc.first_line
        for name in ("first@ci", "second@ci"):
            with tracker.request("k", timeout=HANG_S, client=name):
                pass
        ids = tracker.record("bench", bench_report(), {"commit": "abc123", "branch": "main"})
        tracker.record("bench", bench_report(samples=(0.006, 0.007)), {"commit": "def456"})
        tracker.record("check", check_report(), {"commit": "abc123"})
        assert len(ids["record_ids"]) == 1
        before = tracker.results("bench")
        farm.restart_tracker()
        tracker = farm.client()
        assert tracker.results("bench") == before
        (old,) = tracker.results("bench", labels={"commit": "abc123"})
        assert old["samples_s"] == [0.004, 0.005] and old["median_s"] == pytest.approx(0.0045)
        assert old["labels"] == {"commit": "abc123", "branch": "main"}
        assert old["target"]["triple"] == "aarch64-unknown-linux-gnu"
        assert old["compiler_version"] == "0.1.0" and old["device"] == {"cores": 4}
        assert tracker.results("bench", model="bb" * 32, key="k")[-1]["labels"] == {
            "commit": "def456"}
        assert tracker.results("bench", key="other") == []
        (check,) = tracker.results("check")
        assert check["passed"] and check["outputs"][0]["name"] == "y"
    db = farmdb.FarmDatabase(url)
    try:
        ended = [(s["holder"], s["how"]) for s in db.sessions()]
        assert ("first@ci", "given back by the client") in ended or \
            ("first@ci", "session ended on the board") in ended
        assert {h for h, _ in ended} >= {"first@ci", "second@ci"}
        assert db.counts()["bench"] == 2
    finally:
        db.close()


def test_an_old_database_is_brought_up_to_date_and_keeps_its_records(new_database):
    url = new_database()
    engine = sa.create_engine(url)
    farmdb.upgrade(engine, "0001")  # the first schema: benchmarks and sessions only
    with engine.begin() as connection:
        connection.execute(sa.text(
            "INSERT INTO benchmarks (recorded_at, model_name, key, samples_s, median_s) "
            "VALUES (1700000000.0, 'old.onnx', 'k', '[0.01, 0.02, 0.03]', 0.02)"))
    assert farmdb.schema_revision(engine) == "0001"
    with farm_on(url, keys=()) as farm:
        tracker = farm.client()
        (old,) = tracker.results("bench", model="old.onnx")
        assert old["samples_s"] == [0.01, 0.02, 0.03] and old["labels"] == {}
        assert old["comparison"] is None
        tracker.record("check", check_report(passed=False), {"commit": "x"})
        assert [c["passed"] for c in tracker.results("check")] == [False]
    assert farmdb.schema_revision(engine) == "0003"
    engine.dispose()


def test_bad_reports_are_refused_by_name_and_the_tracker_keeps_serving(tmp_path):
    with farm_on(f"sqlite:///{tmp_path}/farm.sqlite", keys=()) as farm:
        tracker = farm.client()
        no_samples = bench_report()
        del no_samples["results"][0]["samples_s"]
        for kind, report, words in (("bench", no_samples, "has no samples_s"),
                                    ("bench", {"results": "x"}, "no results list"),
                                    ("nonsense", bench_report(), "record kind 'nonsense'"),
                                    ("check", bench_report(), "has no outputs or passed")):
            with pytest.raises(InvalidArgument, match=words):
                tracker.record(kind, report)
        with pytest.raises(InvalidArgument, match="label ''"):
            tracker.record("bench", bench_report(), {"": "x"})
        assert tracker.results("bench") == []
        assert len(tracker.record("bench", bench_report())["record_ids"]) == 1


def test_a_database_server_that_goes_away_is_named_and_the_tracker_keeps_serving():
    with postgres_server() as server:
        url = server.new_database()
        with farm_on(url, keys=()) as farm:
            tracker = farm.client()
            assert tracker.record("bench", bench_report())["record_ids"] == [1]
            server.stop()
            shown = farmdb.shown_url(url)
            with pytest.raises(RemoteError, match=f"the farm database {shown} did not take "
                                                  "the report: .*Connection refused"):
                tracker.record("bench", bench_report())
            with pytest.raises(RemoteError, match=f"the farm database {shown} could not be "
                                                  "read"):
                tracker.results("bench")
            assert tracker.summary()["keys"] == []   # the pool is served as before


def test_a_database_that_cannot_be_opened_is_named():
    url = "postgresql://nobody@127.0.0.1:1/farm"
    done = subprocess.run([sys.executable, "-m", "remote.tracker", "--host", "127.0.0.1",
                           "--port", "0", "--db", url], capture_output=True, text=True,
                          timeout=HANG_S, env=child_env())
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"cannot open the farm database {url}" in done.stderr, done.stderr[-2000:]
    with pytest.raises(InvalidArgument, match="is not a database URL"):
        farmdb.FarmDatabase("not a url")


def test_the_schema_the_code_reads_is_the_one_the_revisions_build(tmp_path):
    """The tables in farmdb.py and the Alembic revisions describe the same columns."""
    engine = sa.create_engine(f"sqlite:///{tmp_path}/farm.sqlite")
    farmdb.upgrade(engine)
    built = sa.inspect(engine)
    for name, table in farmdb.metadata.tables.items():
        assert {c["name"] for c in built.get_columns(name)} == set(table.columns.keys()), name
    engine.dispose()
    with pytest.raises(InvalidArgument, match="written by a newer Tether"):
        engine = sa.create_engine(f"sqlite:///{tmp_path}/farm.sqlite")
        with engine.begin() as connection:
            connection.execute(sa.text("UPDATE alembic_version SET version_num = '9999'"))
        farmdb.upgrade(engine)
