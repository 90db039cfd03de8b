"""20 real device servers, 50 concurrent clients, 1,000 sessions: none lost, none doubled.

Each device server counts, on its own side, the leases it redeemed and any
lease redeemed while another was still live; it logs both when stopped.
"""
import re
import threading

from remote import errors
from tests.test_tracker import local_farm
# The fixture that runs the test with both board servers, as in test_tracker.
from tests.test_tracker import kind  # noqa: F401

SERVERS, CLIENTS, REQUESTS = 20, 50, 1000


def test_load_no_double_lease_no_lost_request():
    with local_farm(keys=[]) as farm:
        for _ in range(SERVERS):
            farm.add_server("load", wait=False)
        farm.wait_for_devices("load", SERVERS)
        tracker = farm.client()
        remaining = iter(range(REQUESTS))
        lock = threading.Lock()
        opened, failures = [], []

        def client():
            while True:
                with lock:
                    if next(remaining, None) is None:
                        return
                try:
                    with tracker.request("load", timeout=120) as sess:
                        with lock:
                            opened.append(sess.session_id)
                except errors.TetherError as exc:
                    with lock:
                        failures.append(exc)

        threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert failures == []
        assert len(set(opened)) == REQUESTS
        summary = tracker.summary()
        assert summary["keys"] == [{"key": "load", "total": SERVERS, "free": SERVERS, "pending": 0}]
        assert summary["waiting"] == []
        redeemed_per_server = []
        for server in farm.servers:
            server.stop()  # SIGTERM: the server logs its lease counts on the way out
            (stats,) = re.findall(r"lease stats: redeemed=(\d+) overlaps=(\d+)", server.log_text())
            redeemed, overlaps = map(int, stats)
            assert overlaps == 0, f"{server.name} held two leases at once"
            redeemed_per_server.append(redeemed)
        assert sum(redeemed_per_server) == REQUESTS, "one device-side session per request"
        assert min(redeemed_per_server) > 0, "every device must have served"
