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


@pytest.fixture
def tracker(farm):
    client = rpc.connect_tracker(*farm.tracker)
    yield client
    client.close()


def wait_free(tracker, within=15.0):
    deadline = time.monotonic() + within
    while True:
        data = tracker.summary()
        if all(d["state"] == "free" for d in data["devices"]) and not data["waiting"]:
            return data
        if time.monotonic() > deadline:
            raise AssertionError(f"the board is still held: {data['devices']} {data['waiting']}")
        time.sleep(0.1)


def test_html_and_text_views(tracker, mlp_module):
    with tracker.request("host", timeout=30) as sess:
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


def interrupt_in(seconds):
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def test_ctrl_c_while_waiting_for_a_board_leaves_no_request_behind(tracker):
    holder = tracker.request("host", timeout=30)
    try:
        timer = interrupt_in(1.0)
        with pytest.raises(KeyboardInterrupt):
            tracker.request("host", timeout=60)
        timer.join()
        deadline = time.monotonic() + 10
        while tracker.summary()["waiting"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tracker.summary()["waiting"] == []
    finally:
        holder.close()
    # Had the interrupted request stayed queued, the board would now go to it.
    data = wait_free(tracker)
    assert data["devices"][0]["holder"] == ""


def test_ctrl_c_during_an_upload_closes_the_session(tracker, tmp_path):
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.truncate(16 << 20)
    sess = tracker.request("host", timeout=30)
    calls = []

    def press_ctrl_c(done, total):
        calls.append(done)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        sess.upload(str(big), progress=press_ctrl_c)
    assert calls[-1] < 16 << 20          # stopped part way
    assert sess.closed
    wait_free(tracker)


def test_ctrl_c_during_a_benchmark_closes_the_session(tracker, mlp_module):
    sess = tracker.request("host", timeout=30)
    sess.upload(mlp_module[1])
    mod = sess.load_module("mlp.so")
    timer = interrupt_in(1.0)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        mod.benchmark(repeat=30, min_repeat_ms=1000)   # half a minute unless interrupted
    timer.join()
    assert time.monotonic() - start < 25
    assert sess.closed
    wait_free(tracker)
