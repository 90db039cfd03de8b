"""The farm page and /metrics of `tether tracker --http`, against a real tracker
with real boards; the page opened in a real headless Chromium when one is
installed (Debian's `chromium` package; tests/run.sh installs it as root)."""
import json
import re
import shutil
import subprocess
import threading
import urllib.request

import pytest

from tests.test_tracker import HANG_S, key_status, local_farm, wait_until

prometheus_parser = pytest.importorskip("prometheus_client.parser")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def farm_page_url(farm) -> str:
    match = re.search(r"farm page (http://\S+/) ", farm.tracker_proc.first_line)
    assert match, farm.tracker_proc.first_line
    return match.group(1)


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=HANG_S) as reply:
        return reply.read()


def post_report(url: str, device_id: str, median_s: float):
    """A `tether bench --json` report of 30 samples around ``median_s`` (1 % spread)."""
    samples = [median_s * (1 + 0.01 * ((i * 7) % 11 - 5) / 5) for i in range(30)]
    report = {"model": {"path": "/models/squeezenet.onnx"}, "results": [
        {"key": "k", "device_id": device_id, "stats_s": {"median": median_s},
         "samples_s": samples}]}
    request = urllib.request.Request(url + "api/bench", data=json.dumps(report).encode(),
                                     method="POST")
    with urllib.request.urlopen(request, timeout=HANG_S) as reply:
        assert json.loads(reply.read())["ok"]


def history_points(url: str, board: str) -> list:
    data = json.loads(get(url + "api/history"))
    return [p for s in data["series"] if s["board"] == board for p in s["points"]]


@pytest.fixture(scope="module")
def farm():
    with local_farm(keys=["k", "k"], tracker_args=["--http", "0"]) as farm:
        yield farm


def test_the_summary_and_metrics_show_the_pool_as_it_is(farm):
    url = farm_page_url(farm)
    tracker = farm.client()
    holder = tracker.request("k", timeout=HANG_S, client="holder@ci")
    waiter_done = threading.Event()

    def wait_for_second():
        with farm.client().request("k", timeout=HANG_S, client="second@ci"):
            pass
        waiter_done.set()

    extra = tracker.request("k", timeout=HANG_S, client="extra@ci")  # both boards in use now
    threading.Thread(target=wait_for_second, daemon=True).start()
    try:
        wait_until(lambda: key_status(tracker, "k")["pending"] == 1, "a request queued")
        data = json.loads(get(url + "api/summary"))
        states = sorted(d["state"] for d in data["devices"])
        assert states == ["in_use", "in_use"]
        assert {d["holder"] for d in data["devices"]} == {"holder@ci", "extra@ci"}
        assert [w["client"] for w in data["waiting"]] == ["second@ci"]
        families = {f.name: f for f in prometheus_parser.text_string_to_metric_families(
            get(url + "metrics").decode())}
        boards = {(s.labels["key"], s.labels["state"]): s.value
                  for s in families["tether_boards"].samples}
        assert boards[("k", "in_use")] == 2 and boards[("k", "free")] == 0
        (queue,) = families["tether_queue_length"].samples
        assert queue.value == 1
        waits = [s for s in families["tether_lease_wait_seconds"].samples
                 if s.name.endswith("_count")]
        assert waits and waits[0].value >= 2
    finally:
        extra.close()
        holder.close()
    assert waiter_done.wait(HANG_S)
    wait_until(lambda: key_status(tracker, "k")["free"] == 2, "both boards free")
    families = {f.name: f for f in prometheus_parser.text_string_to_metric_families(
        get(url + "metrics").decode())}
    sessions = {s.labels["key"]: s.value for s in families["tether_sessions"].samples
                if s.name.endswith("_total")}
    assert sessions["k"] >= 3
    data = json.loads(get(url + "api/summary"))
    assert {s["holder"] for s in data["sessions"]} >= {"holder@ci", "extra@ci", "second@ci"}
    assert any(e["kind"] == "registered" for e in data["events"])


def test_posted_bench_results_are_kept_and_bad_ones_refused(farm):
    url = farm_page_url(farm)
    post_report(url, "k-1", 0.004)
    post_report(url, "k-1", 0.005)
    assert [round(p[1], 6) for p in history_points(url, "k-1")][-2:] == [4.0, 5.0]
    for body in (b"{not json", json.dumps({"model": {"path": "m.onnx"}, "results": [
            {"key": "k", "device_id": "k-1"}]}).encode()):
        request = urllib.request.Request(url + "api/bench", data=body, method="POST")
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=HANG_S)
        assert caught.value.code == 400
    assert "has no samples_s" in caught.value.read().decode()


def test_the_history_marks_regressions_and_outlives_a_tracker_restart():
    with local_farm(keys=[], tracker_args=["--http", "0"]) as farm:
        url = farm_page_url(farm)
        for median in (0.010, 0.010, 0.012, 0.012):   # the third run is 20 % slower
            post_report(url, "k-9", median)
        before = history_points(url, "k-9")
        assert [p[3] is not None for p in before] == [False, False, True, False]
        assert before[2][3] == pytest.approx(1.2, rel=0.02)
        farm.restart_tracker()
        url = farm_page_url(farm)
        assert history_points(url, "k-9") == before
        assert json.loads(get(url + "api/history"))["database"].startswith("sqlite:///")


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium package (headless)")
def test_the_page_in_a_real_browser_shows_boards_queue_and_plots(farm, tmp_path):
    url = farm_page_url(farm)
    post_report(url, "k-2", 0.003)
    post_report(url, "k-2", 0.0036)   # 20 % slower: marked
    tracker = farm.client()
    with tracker.request("k", timeout=HANG_S, client="browser-test@ci"):
        flags = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
                 "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}",
                 "--virtual-time-budget=4000"]
        dom = subprocess.run(flags + ["--dump-dom", url], capture_output=True, text=True,
                             timeout=HANG_S)
        assert dom.returncode == 0, dom.stderr[-2000:]
        shot = tmp_path / "farm.png"
        done = subprocess.run(flags + ["--window-size=1200,900", f"--screenshot={shot}", url],
                              capture_output=True, text=True, timeout=HANG_S)
        assert done.returncode == 0, done.stderr[-2000:]
    html = dom.stdout
    for device in tracker.summary()["devices"]:
        assert device["device_id"] in html
    assert "browser-test@ci" in html and 'class="in_use"' in html
    # The page updated itself several times without being reloaded.
    updates = int(re.search(r'data-updates="(\d+)"', html).group(1))
    assert updates >= 2, updates
    assert re.search(r'<svg class="plot" data-model="squeezenet.onnx on k"', html)
    assert '<circle class="regression"' in html and "(kept in sqlite:///" in html
    assert shot.stat().st_size > 3_000  # a rendered page, not an empty image
