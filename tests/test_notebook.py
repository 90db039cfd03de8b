"""What a notebook user sees and what Ctrl-C leaves behind, against a real
tracker and device server: the HTML and text views of sessions, modules,
benchmark results and the pool, and KeyboardInterrupt during a queue wait,
an upload and a benchmark."""
import os
import re
import signal
import threading
import time
from html.parser import HTMLParser

import pytest

from remote import rpc
from remote.client import display


class Tables(HTMLParser):
    """Every <table> in a piece of HTML as {caption, headers, rows}."""

    def __init__(self, text):
        super().__init__()
        self.tables, self._cell, self._row, self._in = [], None, None, None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append({"caption": "", "headers": [], "rows": []})
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th", "caption"):
            self._cell, self._in = [], tag

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)

    def handle_endtag(self, tag):
        table = self.tables[-1] if self.tables else None
        if tag in ("td", "th") and self._cell is not None:
            self._row.append(("".join(self._cell), tag))
            self._cell = None
        elif tag == "caption":
            table["caption"] = "".join(self._cell)
            self._cell = None
        elif tag == "tr":
            if all(kind == "th" for _, kind in self._row):
                table["headers"] = [text for text, _ in self._row]
            else:
                table["rows"].append([text for text, _ in self._row])


def rows_by_first(table):
    return {row[0]: row[1:] for row in table["rows"]}


# Only a hang takes this long: every wait below ends as soon as its state is seen.
HANG_S = 300.0
# CPU time (in clock ticks, 10 ms each on Linux) an idle worker process never
# spends, but one timing a module soon does.
BUSY_TICKS = 20


@pytest.fixture
def tracker(farm):
    client = rpc.connect_tracker(*farm.tracker)
    yield client
    client.close()


def wait_until(condition, what, timeout=HANG_S):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen within {timeout:g} s")
        time.sleep(0.05)


def wait_free(tracker):
    """The summary once every board is free and nobody waits."""
    def free():
        data = tracker.summary()
        if all(d["state"] == "free" for d in data["devices"]) and not data["waiting"]:
            return data
        return None
    return wait_until(free, "every board free and the queue empty")


class CtrlC(threading.Thread):
    """Presses Ctrl-C on this process (SIGINT, as Jupyter's interrupt does) once
    ``ready()`` holds, so that the main thread is interrupted in the state the
    test names rather than at a moment picked by a clock. Use it as
    ``with CtrlC(ready, what), pytest.raises(KeyboardInterrupt): ...``."""

    def __init__(self, ready, what):
        super().__init__(name="ctrl-c", daemon=True)
        self.ready, self.what = ready, what
        self.error = None
        self.done = threading.Event()  # the block ended: press nothing any more

    def run(self):
        try:
            wait_until(lambda: self.done.is_set() or self.ready(), self.what)
        except BaseException as exc:  # noqa: BLE001 - raised in the test by __exit__
            self.error = exc
        if not self.done.is_set():
            # Pressed even when the state never came, so that the test ends, not hangs.
            os.kill(os.getpid(), signal.SIGINT)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.done.set()
        self.join()
        if self.error is not None and exc_type is None:
            raise self.error


def worker_pid(farm, sess):
    """The board process that runs this session's modules, as its server logged it."""
    pattern = rf"session {re.escape(sess.session_id[:8])} runs in process (\d+)"
    deadline = time.monotonic() + 60
    while not re.search(pattern, farm.servers[0].log_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    match = re.search(pattern, farm.servers[0].log_text())
    assert match, farm.servers[0].log_text()
    return int(match.group(1))


def cpu_ticks(pid):
    """User plus system CPU time the process has used, in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime and stime, fields 14 and 15


def test_html_and_text_views(tracker, mlp_module):
    with tracker.request("host", timeout=HANG_S, call_timeout=HANG_S) as sess:
        sess.upload(mlp_module[1])
        mod = sess.load_module("mlp.so")
        res = mod.benchmark(number=2, repeat=3)

        (table,) = Tables(sess._repr_html_()).tables
        rows = rows_by_first(table)
        info = sess.device_info()
        assert rows["address"] == [sess.address] and rows["state"] == ["open"]
        assert rows["triple"] == [info["triple"]] and rows["cores"] == [str(info["cores"])]
        assert sess.address in str(sess) and info["triple"] in str(sess)

        (table,) = Tables(mod._repr_html_()).tables
        assert table["headers"] == ["", "name", "dtype", "shape"]
        assert table["rows"] == [["input", "input", "float32", "1x1x28x28"],
                                 ["output", "output", "float32", "1x10"]]
        assert "loaded in" in table["caption"] and mod.module_id in table["caption"]
        assert "1x1x28x28" in str(mod)

        (table,) = Tables(res._repr_html_()).tables
        rows = rows_by_first(table)
        assert rows["median"] == [display.ms(res.median)]
        assert rows["p99"] == [display.ms(res.p99)]
        assert rows["runs"] == ["3 x 2"]
        assert res.peak_rss_bytes > 1 << 20
        assert rows["peak memory"] == [display.size(res.peak_rss_bytes)]
        assert re.search(r"^median +" + re.escape(display.ms(res.median)) + "$", str(res), re.M)

        held = Tables(tracker._repr_html_()).tables
        assert [t["caption"] for t in held] == ["keys", "devices",
                                                "queue, in the order it will be served"]
        assert held[0]["rows"] == [["host", "1", "0", "0"]]
        (device,) = held[1]["rows"]
        assert device[1:4] == ["host", sess.address, "in_use"]
        assert held[2]["rows"] == []
    summary = tracker.summary()
    assert "STATE" in str(summary) and "free" in str(summary)   # what `tether status` prints
    free = Tables(summary._repr_html_()).tables
    assert free[1]["rows"][0][3] == "free" and free[1]["rows"][0][4] == "-"
    (table,) = Tables(sess._repr_html_()).tables
    assert rows_by_first(table)["state"] == ["closed"]


def test_html_escapes_what_devices_report():
    html = display.html_table(("a",), [("<script>x</script>",)])
    (table,) = Tables(html).tables
    assert table["rows"] == [["<script>x</script>"]] and "<script>" not in html


def test_ctrl_c_while_waiting_for_a_board_leaves_no_request_behind(tracker):
    holder = tracker.request("host", timeout=HANG_S, client="holder")
    try:
        queued = CtrlC(lambda: [w["client"] for w in tracker.summary()["waiting"]] == ["second"],
                       "the second request in the tracker's queue")
        with queued, pytest.raises(KeyboardInterrupt):
            tracker.request("host", timeout=HANG_S, client="second")
        wait_until(lambda: tracker.summary()["waiting"] == [],
                   "the interrupted request leaving the queue")
    finally:
        holder.close()
    # Had the interrupted request stayed queued, the board would now go to it.
    data = wait_free(tracker)
    assert data["devices"][0]["holder"] == ""


def test_ctrl_c_during_an_upload_closes_the_session(tracker, tmp_path):
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.truncate(16 << 20)
    # The upload's first chunk waits for the session's worker process to read it;
    # on a loaded machine that process may still be starting.
    sess = tracker.request("host", timeout=HANG_S, call_timeout=HANG_S)
    calls = []

    def press_ctrl_c(done, total):
        calls.append(done)
        if done > 0 and len(calls) == 2:  # pressed from inside the upload, a chunk in
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        sess.upload(str(big), progress=press_ctrl_c)
    assert len(calls) == 2 and 0 < calls[-1] < 16 << 20    # stopped part way
    assert sess.closed
    wait_free(tracker)


def test_ctrl_c_during_a_benchmark_closes_the_session(farm, tracker, mlp_module):
    sess = tracker.request("host", timeout=HANG_S, call_timeout=HANG_S)
    sess.upload(mlp_module[1])
    mod = sess.load_module("mlp.so")
    board = worker_pid(farm, sess)
    idle = cpu_ticks(board)
    # Ctrl-C once the board is timing the module (its worker spending CPU), not
    # at a fixed moment that a loaded machine may not have reached yet.
    timing = CtrlC(lambda: cpu_ticks(board) > idle + BUSY_TICKS, "the board timing the module")
    with timing, pytest.raises(KeyboardInterrupt):
        # An hour of samples: nothing but Ctrl-C ends it while the test runs.
        mod.benchmark(repeat=3600, min_repeat_ms=1000)
    assert sess.closed
    wait_free(tracker)
