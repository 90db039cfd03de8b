"""The tracker's scheduler as plain data: no sockets, no clocks."""
import itertools

import pytest

from remote.tracker.scheduler import FREE, IN_USE, LEASED, LeaseRefused, Request, Scheduler


def make_scheduler(**kw):
    counter = itertools.count()
    return Scheduler(new_token=lambda: f"tok{next(counter)}", **kw)


def test_priority_first_then_fifo():
    s = make_scheduler()
    s.enqueue(Request("low-early", "k", priority=0, enqueued_at=0))
    s.enqueue(Request("high", "k", priority=5, enqueued_at=1))
    s.enqueue(Request("low-late", "k", priority=0, enqueued_at=2))
    served = []
    s.register("d", "k", "a:1", {}, now=0)
    for _ in range(3):
        ((request, lease),) = s.assign(now=3)
        served.append(request.request_id)
        s.release(lease.token, now=3)
    assert served == ["high", "low-early", "low-late"]


def test_no_device_is_leased_twice():
    s = make_scheduler()
    s.register("d", "k", "a:1", {}, now=0)
    s.enqueue(Request("r1", "k"))
    s.enqueue(Request("r2", "k"))
    granted = s.assign(now=1)
    assert [r.request_id for r, _ in granted] == ["r1"]
    assert s.assign(now=2) == []
    assert [r.request_id for r in s.waiting()] == ["r2"]


def test_keys_and_filters_match():
    s = make_scheduler()
    s.register("pi3", "arm", "a:1", {"board": "rpi3"}, now=0)
    s.register("pi4", "arm", "a:2", {"board": "rpi4"}, now=1)
    s.enqueue(Request("want4", "arm", filters={"board": "rpi4"}))
    s.enqueue(Request("other-key", "x86"))
    ((request, lease),) = s.assign(now=2)
    assert (request.request_id, lease.device_id) == ("want4", "pi4")
    assert [r.request_id for r in s.waiting()] == ["other-key"]


def test_lease_token_redeemed_once_and_only_on_its_device():
    s = make_scheduler()
    s.register("d1", "k", "a:1", {}, now=0)
    s.register("d2", "k", "a:2", {}, now=0)
    s.enqueue(Request("r", "k"))
    ((_, lease),) = s.assign(now=1)
    other = "d2" if lease.device_id == "d1" else "d1"
    with pytest.raises(LeaseRefused):
        s.redeem(other, lease.token, now=2)
    with pytest.raises(LeaseRefused):
        s.redeem(lease.device_id, "guess", now=2)
    s.redeem(lease.device_id, lease.token, now=2)
    assert s.devices[lease.device_id].state == IN_USE
    with pytest.raises(LeaseRefused, match="already used"):
        s.redeem(lease.device_id, lease.token, now=3)


def test_unused_lease_expires_and_device_returns():
    s = make_scheduler(unused_lease_s=10)
    s.register("d", "k", "a:1", {}, now=0)
    s.enqueue(Request("r", "k"))
    ((_, lease),) = s.assign(now=0)
    assert s.devices["d"].state == LEASED
    assert s.expire_unused(now=5) == []
    assert [l.token for l in s.expire_unused(now=11)] == [lease.token]
    assert s.devices["d"].state == FREE


def test_redeemed_lease_does_not_expire():
    s = make_scheduler(unused_lease_s=10)
    s.register("d", "k", "a:1", {}, now=0)
    s.enqueue(Request("r", "k"))
    ((_, lease),) = s.assign(now=0)
    s.redeem("d", lease.token, now=1)
    assert s.expire_unused(now=100) == []


def test_silent_devices_are_evicted_with_their_leases():
    s = make_scheduler()
    s.register("quiet", "k", "a:1", {}, now=0)
    s.register("alive", "k", "a:2", {}, now=0)
    s.enqueue(Request("r", "k"))
    ((_, lease),) = s.assign(now=0)
    s.heartbeat("alive", now=8)
    s.heartbeat("quiet", now=2)
    evicted = s.evict_silent(now=9, window_s=5)
    assert [d.device_id for d in evicted] == ["quiet"]
    assert s.served_keys() == ["k"]
    if lease.device_id == "quiet":
        assert lease.token not in s.leases
    assert not s.heartbeat("quiet", now=10)


def test_cancelled_request_leaves_queue():
    s = make_scheduler()
    s.enqueue(Request("r", "k"))
    s.cancel("r")
    s.register("d", "k", "a:1", {}, now=0)
    assert s.assign(now=1) == []


def test_summary_counts_per_key():
    s = make_scheduler()
    s.register("d1", "k", "a:1", {}, now=0)
    s.register("d2", "k", "a:2", {}, now=0)
    s.enqueue(Request("r1", "k", client="alice", enqueued_at=1))
    s.assign(now=1)
    s.enqueue(Request("r2", "other", client="bob", priority=3, enqueued_at=2))
    data = s.summary(now=4)
    assert {k["key"]: (k["total"], k["free"], k["pending"]) for k in data["keys"]} == {
        "k": (2, 1, 0), "other": (0, 0, 1)}
    assert [d["holder"] for d in data["devices"] if d["state"] == LEASED] == ["alice"]
    assert data["waiting"] == [{"key": "other", "priority": 3, "client": "bob", "waited_s": 2}]


def test_reregistration_keeps_live_sessions_in_use():
    s = make_scheduler()
    s.register("d", "k", "a:1", {}, now=0)
    s.enqueue(Request("r", "k"))
    ((_, lease),) = s.assign(now=0)
    s.redeem("d", lease.token, now=1)
    fresh = make_scheduler()  # a restarted tracker knows nothing
    fresh.register("d", "k", "a:1", {}, now=5, live_tokens=[lease.token])
    assert fresh.devices["d"].state == IN_USE
    fresh.enqueue(Request("r2", "k"))
    assert fresh.assign(now=6) == []
    fresh.release(lease.token, now=7)
    assert [r.request_id for r, _ in fresh.assign(now=8)] == ["r2"]
    # Registering again without the token (the session ended meanwhile) frees it.
    s.register("d", "k", "a:1", {}, now=9)
    assert s.devices["d"].state == FREE and lease.token not in s.leases


def test_device_free_longest_is_leased_first():
    s = make_scheduler()
    s.register("a", "k", "a:1", {}, now=0)
    s.register("b", "k", "a:2", {}, now=1)
    s.enqueue(Request("r1", "k"))
    ((_, first),) = s.assign(now=2)
    assert first.device_id == "a"
    s.release(first.token, now=3)
    s.enqueue(Request("r2", "k"))
    ((_, second),) = s.assign(now=4)
    assert second.device_id == "b", "b has been free since 1, a only since 3"
