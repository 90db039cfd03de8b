"""``tether bench``: one model timed on one or many boards of a key at once.

Each board gets its own thread: lease, open a session, upload, load the module
twice (cold, then warm), time it on the board, close. The report is a table
per board; ``--json`` keeps the raw samples and everything needed to run the
same measurement again, and ``--vs`` compares with such a file.

Ctrl-C at any point closes every session and returns every lease before the
command ends.
"""
from __future__ import annotations

import csv
import datetime
import json
import os
import platform
import sys
import threading
from typing import List, Optional

from minirt.timing import summarize
from remote import errors
from remote import regression
from remote.cli import modelfile, recording
from remote.cli.progress import ByteBar, Ticker, say
from remote.client import display
from remote.client.session import Session
from remote.client.tracker import Lease, TrackerClient, default_client_name
from remote.defaults import TRACKER_HELP

SCHEMA = "tether.bench/1"
# Statistics compared against an earlier run, in the order they are shown.
COMPARED = display.STATS + ("cold_load", "warm_load")
# --profile shows this many of the slowest steps per board (the JSON keeps all).
PROFILE_SHOWN = 10


def tool_version() -> str:
    try:
        from importlib.metadata import version
        return version("tether")
    except Exception:  # noqa: BLE001 - not installed, e.g. run from a checkout
        return "unknown"


class Farm:
    """The boards this command holds, so that Ctrl-C can give every one back."""

    def __init__(self, tracker: TrackerClient, waiter: TrackerClient):
        self.tracker = tracker      # releases leases; stays open until the end
        self.waiter = waiter        # waits in the queue; closing it cancels the waits
        self.lock = threading.Lock()
        self.cancelled = False
        self.leases: List[Lease] = []
        self.sessions: List[Session] = []

    def give_back(self, lease: Lease) -> None:
        try:
            self.tracker.release(lease)
        except (errors.TetherError, ValueError):
            pass  # the tracker expires a lease nobody returns

    def hold_lease(self, lease: Lease) -> None:
        with self.lock:
            if not self.cancelled:
                self.leases.append(lease)
                return
        self.give_back(lease)
        raise KeyboardInterrupt

    def hold_session(self, sess: Session) -> None:
        with self.lock:
            if not self.cancelled:
                self.sessions.append(sess)
                return
        sess.close()
        raise KeyboardInterrupt

    def cancel(self) -> int:
        """Close every session, return every lease, stop waiting; how many boards were held."""
        with self.lock:
            self.cancelled = True
            sessions, leases = list(self.sessions), list(self.leases)
        self.waiter.close()
        for sess in sessions:
            sess.close()  # the board returns its lease once its session is gone
        in_session = {s.address for s in sessions}
        for lease in leases:
            if lease.address not in in_session:
                self.give_back(lease)
        return len(leases)


class BoardRun(threading.Thread):
    """Everything done on one board, in its own thread."""

    def __init__(self, index: int, farm: Farm, modules: modelfile.ModuleChoice, args,
                 baselines: Optional[modelfile.ModuleChoice] = None):
        super().__init__(name=f"board-{index}", daemon=True)
        self.index = index
        self.farm = farm
        self.modules = modules
        self.baselines = baselines  # --baseline-module: timed in turns with the module
        self.module: Optional[modelfile.ModuleFile] = None
        self.args = args
        self.lease: Optional[Lease] = None
        self.record: Optional[dict] = None
        self.error: Optional[BaseException] = None
        self.metadata: dict = {}

    def run(self):
        try:
            self.record = self._measure()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            self.error = exc

    def _measure(self) -> dict:
        args, farm = self.args, self.farm
        client = default_client_name()
        lease = farm.waiter.lease(args.key, timeout=args.wait, client=client)
        farm.hold_lease(lease)
        self.lease = lease
        label = f"[{lease.device_id}]"
        say(f"{label} leased {lease.address}")
        sess = Session(lease.address, lease_token=lease.token, client=client,
                       timeout=args.timeout or DEFAULT_CALL_TIMEOUT_S, tls_ca=farm.tracker.tls_ca,
                       on_close=lambda: farm.give_back(lease), device_id=lease.device_id,
                       relayed=lease.relayed)
        farm.hold_session(sess)
        with sess:
            info = sess.device_info()
            self.module = self.modules.for_board(info)
            bar = ByteBar(f"{label} upload {os.path.basename(self.module.path)}",
                          position=self.index)
            try:
                name = sess.upload(self.module.path, progress=bar)
            finally:
                bar.close()
            cold = modelfile.load_for_board(sess, name, info)
            warm = sess.load_module(name)  # the library is on the board and mapped now
            self.metadata = cold.metadata
            samples, number, res, extra = self._time(sess, cold, name, info, label)
            if args.profile:
                say(f"{label} profiling each layer: {res.number} runs")
                try:
                    profile = cold.profile(number=res.number, timeout=_benchmark_timeout(args))
                    extra["profile"] = profile.as_dict()["rows"]
                except errors.ModuleLoadError as exc:  # built without tether_run_profiled
                    say(f"{label} --profile: {exc}")
                    extra["profile_error"] = str(exc)
        return {
            "device_id": lease.device_id, "key": lease.key, "address": lease.address,
            "device": info, "samples_s": samples, "number": number,
            "repeat": len(samples), "stats_s": summarize(samples),
            "cold_load_s": cold.load_s, "warm_load_s": warm.load_s,
            "peak_rss_bytes": res.peak_rss_bytes, "threads": res.threads, **extra,
        }

    def _time(self, sess: Session, cold, name: str, info: dict, label: str) -> tuple:
        """The module's samples on the board (with --baseline-module, in turns
        with the baseline's, which go under "baseline" in the extra fields):
        (samples, number, the last BenchmarkResult, extra fields)."""
        args = self.args
        extra = {}
        if self.baselines is None:
            with Ticker(f"{label} benchmarking: {args.repeat} samples"
                        + (f" of at least {args.min_repeat_ms:g} ms" if args.min_repeat_ms
                           else "") + " on the board"):
                res = cold.benchmark(number=args.number, repeat=args.repeat,
                                     min_repeat_ms=args.min_repeat_ms,
                                     cooldown_ms=args.cooldown_ms,
                                     timeout=_benchmark_timeout(args))
            samples, number = res.samples, res.number
        else:
            baseline = self.baselines.for_board(info)
            base = _load_baseline(sess, baseline, name, info, label, self.index)
            with Ticker(f"{label} benchmarking against {os.path.basename(baseline.source)} "
                        f"interleaved: {args.repeat} rounds on the board"):
                (samples, number, res), (base_samples, base_number, _) = \
                    interleave((cold, name), (base["loaded"], base["name"]), args)
            extra["baseline"] = {
                "module": baseline.describe(), "samples_s": base_samples,
                "number": base_number, "stats_s": summarize(base_samples),
                "cold_load_s": base["cold"], "warm_load_s": base["warm"]}
        return samples, number, res, extra


def _load_baseline(sess: Session, baseline: modelfile.ModuleFile, taken: str, info: dict,
                   label: str, position: int) -> dict:
    """Upload and load the --baseline-module next to the module (named apart
    from it: both are often net.so); its loaded module and load times."""
    target = "baseline-" + os.path.basename(baseline.path)
    if target == taken:
        target = "baseline-" + target
    bar = ByteBar(f"{label} upload {os.path.basename(baseline.source)} (baseline)",
                  position=position)
    try:
        name = sess.upload(baseline.path, target=target, progress=bar)
    finally:
        bar.close()
    cold = modelfile.load_for_board(sess, name, info)
    warm = sess.load_module(name)
    return {"loaded": cold, "name": name, "cold": cold.load_s, "warm": warm.load_s}


def interleave(new: tuple, base: tuple, args) -> tuple:
    """``args.repeat`` rounds on one board, one sample of each module per
    round, in turns: new first in even rounds, the baseline first in odd ones,
    so that neither always runs just after the other. Each module is timed
    once before the rounds (not kept), which warms it up and tells how many
    runs fill --min-repeat-ms; both then take the larger ``number`` of runs
    per sample, so that their samples last alike.

    Every few rounds (fresh_every) both modules are loaded again. A loaded
    module keeps its own worker threads, and on a busy machine one module's
    threads can stay badly placed for seconds: on a 2-core machine with a
    load of 8, one of two identical modules ran 2 to 8 times slower than the
    other for the last half of 100 rounds. Fresh threads every few rounds
    give each module many draws of that luck instead of one.
    ``new`` and ``base`` are (loaded module, its file's name on the board).
    Per module: (samples, number, the last BenchmarkResult)."""
    first = [mod.benchmark(number=args.number, repeat=1, min_repeat_ms=args.min_repeat_ms,
                           timeout=_benchmark_timeout(args)) for mod, _ in (new, base)]
    number = max(res.number for res in first)
    sample_s = max(res.samples[0] for res in first) * number
    timeout = args.timeout or max(DEFAULT_CALL_TIMEOUT_S, 3 * sample_s + 10.0)
    timed = [{"mod": mod, "name": name, "samples": [], "last": res}
             for (mod, name), res in zip((new, base), first)]
    every = fresh_every(args.repeat, [mod.metadata for mod, _ in (new, base)])
    for round_ in range(args.repeat):
        if round_ and round_ % every == 0:
            for side in timed:
                side["mod"] = side["mod"].session.load_module(side["name"])
        for side in (timed if round_ % 2 == 0 else timed[::-1]):
            res = side["mod"].benchmark(number=number, repeat=1, cooldown_ms=args.cooldown_ms,
                                        timeout=timeout)
            side["samples"].append(res.samples[0])
            side["last"] = res
    return tuple((side["samples"], number, side["last"]) for side in timed)


def fresh_every(rounds: int, metadata: List[dict]) -> int:
    """How many rounds go between fresh loads of the modules: FRESH_EVERY, or
    more for modules with large workspaces. A session keeps every module it
    loaded, each with its workspace, so the loads of one comparison hold at
    most FRESH_LOADS_BYTES of workspaces.

    >>> small, large = {"workspace_bytes": 1 << 20}, {"workspace_bytes": 16 << 20}
    >>> fresh_every(100, [small, small]), fresh_every(100, [large, large])
    (5, 13)
    """
    per_load = sum(int(m.get("workspace_bytes", 0)) for m in metadata)
    loads = FRESH_LOADS_BYTES // per_load if per_load else rounds
    return max(FRESH_EVERY, -(-rounds // max(loads, 1)))


def post_report(url: str, report: dict) -> None:
    """Send a report to a farm page's /api/bench."""
    import urllib.error
    import urllib.request

    target = url.rstrip("/") + "/api/bench"
    request = urllib.request.Request(target, data=json.dumps(report).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            reply.read()
    except (urllib.error.URLError, OSError) as exc:
        raise ValueError(f"--post {url}: the farm page did not take the report ({exc}); is "
                         "the tracker started with --http?") from None


def _benchmark_timeout(args) -> Optional[float]:
    """--timeout when given; otherwise None: the benchmark derives one from a
    first timed run on the board, so a slow (emulated) board gets the time it needs."""
    return args.timeout


def _device_count(tracker: TrackerClient, key: str, wanted: str) -> int:
    keys = {k["key"]: k for k in tracker.summary()["keys"]}
    if key not in keys:
        raise errors.NoSuchKey(f"no device registered under key {key!r}; registered keys: "
                               f"{', '.join(sorted(keys)) or '(none)'}")
    total = keys[key]["total"]
    if wanted == "all":
        return total
    try:
        count = int(wanted)
    except ValueError:
        raise ValueError(f"--devices {wanted!r}: give a number of boards or 'all'") from None
    if count < 1:
        raise ValueError(f"--devices {count}: at least one board is needed")
    if count > total:
        raise ValueError(f"--devices {count}: key {key!r} has only {total} board(s); "
                         f"use --devices {total} or --devices all")
    return count


def _check_options(args) -> None:
    if (args.number is not None and args.number < 1) or args.repeat < 1:
        raise ValueError(f"--number ({args.number}) and --repeat ({args.repeat}) must be at "
                         "least 1")
    if args.min_repeat_ms < 0 or args.cooldown_ms < 0:
        raise ValueError("--min-repeat-ms and --cooldown-ms must not be negative")
    if args.plot:
        _matplotlib()
    if args.vs:
        load_report(args.vs)
    recording.parse_labels(args.label)
    args.max_regression_fraction = regression.parse_threshold(args.max_regression)


def _matplotlib():
    try:
        import matplotlib
    except ImportError:
        from remote.cli.extras import install_command
        raise ValueError("--plot needs matplotlib, which is not installed; install it with: "
                         + install_command("plot", "matplotlib>=3.3")) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def load_report(path: str, option: str = "--vs") -> dict:
    """An earlier ``--json`` file, checked enough to compare against."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{option} {path!r}: no such file; give a file written by "
                                "`tether bench --json`") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{option} {path!r} is not JSON ({exc}); give a file written by "
                         "`tether bench --json`") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not data.get("results"):
        raise ValueError(f"{option} {path!r} is not a `tether bench --json` result "
                         f"(expected schema {SCHEMA!r} with results)")
    return data


def _value(record: dict, name: str) -> float:
    if name in ("cold_load", "warm_load"):
        return record[name + "_s"]
    return record["stats_s"][name]


def _match(record: dict, old_results: list, index: int) -> dict:
    """The earlier result for the same board, else the one in the same place."""
    for old in old_results:
        if old.get("device_id") == record["device_id"]:
            return old
    return old_results[min(index, len(old_results) - 1)]


def ratios(record: dict, old: dict) -> dict:
    """new / old for every compared statistic (below 1: faster now)."""
    out = {}
    for name in COMPARED:
        before = _value(old, name)
        out[name] = _value(record, name) / before if before else None
    return out


# ------------------------------------------------------------ baseline --
def baseline_records(spec: str, tracker: TrackerClient, model: str, key: str) -> tuple:
    """What ``--baseline`` names: (how to say it, per-board results with
    ``device_id`` and ``samples_s``). A FILE.json from ``--json``, or NAME=VALUE:
    the farm database's benchmarks of this model on this key with that label."""
    if spec.endswith(".json") or os.path.isfile(spec):
        data = load_report(spec, option="--baseline")
        return spec, data["results"]
    name, sep, value = spec.partition("=")
    if not sep or not name:
        raise ValueError(f"--baseline {spec!r}: give a FILE.json written by --json, or "
                         "NAME=VALUE naming recorded runs, e.g. commit=abc123")
    found = tracker.results("bench", model=os.path.basename(model), key=key,
                            labels={name: value})
    if not found:
        raise ValueError(f"--baseline {spec}: the farm database has no benchmark of "
                         f"{os.path.basename(model)} on key {key!r} labelled {spec}; record one "
                         f"first (tether bench ... --label {spec})")
    return f"{spec} ({len(found)} recorded run(s))", found


def baseline_runs(record: dict, results: list) -> list:
    """The baseline's runs (lists of samples) from the same board when it has
    some, else from every board."""
    same = [r["samples_s"] for r in results if r.get("device_id") == record["device_id"]]
    return same or [r["samples_s"] for r in results]


# ------------------------------------------------------------- reports --
def _headline(record: dict) -> str:
    d = record["device"]
    return (f"device {record['device_id']} at {record['address']} (key {record['key']}): "
            f"{d['machine'] or '?'}, {display.board_cpu(d)}, {d['cores']} cores, "
            f"{display.size(d['memory_bytes'])}, {d['os'] or '?'}")


def board_table(record: dict, old: Optional[dict] = None, before: str = "BEFORE") -> str:
    rows = []
    comparison = ratios(record, old) if old else {}
    for name in COMPARED:
        label = name.replace("_", " ")
        row = [label, display.ms(_value(record, name))]
        if old:
            ratio = comparison[name]
            row += [display.ms(_value(old, name)), "-" if ratio is None else f"{ratio:.3f}x"]
        rows.append(tuple(row))
    rows.append(("peak memory", display.size(record["peak_rss_bytes"]))
                + (("", "") if old else ()))
    rows.append(("runs", f"{record['repeat']} x {record['number']}") + (("", "") if old else ()))
    rows.append(("threads", display.threads(record.get("threads", 0))) + (("", "") if old else ()))
    headers = ("STATISTIC", "VALUE") + ((before, "RATIO") if old else ())
    return _headline(record) + "\n" + "\n".join(
        "  " + line for line in display.text_table(headers, rows).splitlines())


def profile_table(record: dict) -> str:
    """The slowest layers of one board's --profile, or why there are none."""
    if "profile_error" in record:
        return f"  per-layer profile unavailable: {record['profile_error']}"
    rows = record.get("profile") or []
    total = sum(r["mean_s"] for r in rows)
    shown = min(PROFILE_SHOWN, len(rows))
    title = (f"  slowest {shown} of {len(rows)} layers ({display.ms(total)} per run, "
             "single thread):")
    return title + "\n" + "\n".join(
        "    " + line for line in display.text_table(display.PROFILE_HEADERS,
                                                    display.profile_rows(rows, PROFILE_SHOWN))
        .splitlines())


def build_report(args, modules: modelfile.ModuleChoice, runs: List[BoardRun],
                 tracker: str) -> dict:
    metadata = next((r.metadata for r in runs if r.metadata), {})
    return {
        "schema": SCHEMA,
        "tool": {"name": "tether", "version": tool_version(), "python": platform.python_version()},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": ["tether", *sys.argv[1:]],
        "model": next((r.module for r in runs if r.module), modules.first).describe(),
        "target": metadata.get("target", {"name": args.target}),
        "compiler": metadata.get("producer") or f"tether {tool_version()}",
        "labels": recording.parse_labels(args.label),
        "module": {"inputs": metadata.get("inputs", []), "outputs": metadata.get("outputs", [])},
        "options": {"key": args.key, "devices": args.devices, "number": args.number,
                    "repeat": args.repeat, "min_repeat_ms": args.min_repeat_ms,
                    "cooldown_ms": args.cooldown_ms, "target": args.target,
                    "precision": args.precision},
        "tracker": tracker,
        "results": [r.record for r in runs if r.record is not None],
        "failures": [{"device_id": r.lease.device_id if r.lease else None,
                      "error": f"{type(r.error).__name__}: {r.error}"}
                     for r in runs if r.error is not None],
    }


def write_csv(path: str, results: List[dict]) -> None:
    columns = ["device_id", "key", "address"] + [f"{s}_ms" for s in COMPARED] + [
        "peak_rss_bytes", "number", "repeat"]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for r in results:
            writer.writerow([r["device_id"], r["key"], r["address"]]
                            + [f"{_value(r, s) * 1e3:.9g}" for s in COMPARED]
                            + [r["peak_rss_bytes"], r["number"], r["repeat"]])


def write_plot(path: str, report: dict, old: Optional[dict]) -> None:
    """Box plots of the per-sample latency of every board (and of the earlier run)."""
    plt = _matplotlib()
    series, labels = [], []
    for tag, data in (("", report), (" (before)", old)):
        if data is None:
            continue
        for r in data["results"]:
            series.append([s * 1e3 for s in r["samples_s"]])
            labels.append(f"{r['device_id']}{tag}")
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(series) + 2), 4))
    ax.boxplot(series)
    ax.set_xticks(range(1, len(labels) + 1))
    ax.set_xticklabels(labels, rotation=20, ha="right")
    ax.set_ylabel("latency per run (ms)")
    ax.set_title(f"{os.path.basename(report['model']['path'])} on "
                 f"{report['target'].get('name', '?')}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------- main --
def run_bench(args, tracker_address) -> int:
    _check_options(args)
    old = load_report(args.vs) if args.vs else None
    options = dict(input_shapes=modelfile.parse_input_shapes(args.input_shape),
                   tuned=not args.no_tuning, say=say, precision=args.precision,
                   dynamic=modelfile.parse_dynamic(args.dynamic))
    modules = modelfile.ModuleChoice(args.model, args.target, **options)
    try:
        baselines = (modelfile.ModuleChoice(args.baseline_module, args.target, **options)
                     if args.baseline_module else None)
    except (FileNotFoundError, ValueError) as exc:
        modules.cleanup()
        raise type(exc)(f"--baseline-module: {exc}") from None
    except BaseException:
        modules.cleanup()
        raise
    host, port = tracker_address
    tracker = TrackerClient(host, port, tls_ca=args.tls_ca)
    waiter = TrackerClient(host, port, tls_ca=args.tls_ca)
    farm = Farm(tracker, waiter)
    try:
        baseline = (baseline_records(args.baseline, tracker, args.model, args.key)
                    if args.baseline else None)
        count = _device_count(tracker, args.key, args.devices)
        say(f"benchmarking on {count} board(s) of key {args.key!r}")
        runs = [BoardRun(i, farm, modules, args, baselines) for i in range(count)]
        try:
            for run in runs:
                run.start()
            for run in runs:
                while run.is_alive():
                    run.join(0.2)  # short joins keep Ctrl-C reaching this thread
        except KeyboardInterrupt:
            held = farm.cancel()
            for run in runs:
                run.join(5.0)
            say(f"interrupted: closed the sessions and returned {held} board(s)")
            raise
        report = build_report(args, modules, runs, tracker.address)
        regressed = (compare_interleaved(report, args.max_regression_fraction) if baselines
                     else compare_with_baseline(report, baseline, args.max_regression_fraction))
        # --post hands the report to a farm page, whose tracker records it.
        if not args.no_record and not args.post and report["results"]:
            recording.record_report(tracker, "bench", report, report["labels"], say)
    finally:
        waiter.close()
        tracker.close()
        modules.cleanup()
        if baselines:
            baselines.cleanup()

    old_results = old["results"] if old else None
    for i, record in enumerate(report["results"]):
        if old_results:
            print(board_table(record, _match(record, old_results, i)))
        else:  # with --baseline-module, the baseline timed in the same rounds
            print(board_table(record, record.get("baseline") if baselines else None,
                              "BASELINE"))
        if "profile" in record or "profile_error" in record:
            print(profile_table(record))
        print()
    for failure in report["failures"]:
        say(f"tether bench: board {failure['device_id'] or '?'} failed: {failure['error']}")
    if args.post:
        post_report(args.post, report)
        say(f"posted the report to {args.post}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        say(f"wrote {args.json}")
    if args.csv:
        write_csv(args.csv, report["results"])
        say(f"wrote {args.csv}")
    if args.plot and report["results"]:
        write_plot(args.plot, report, old)
        say(f"wrote {args.plot}")
    if not report["results"]:
        raise errors.TetherError(f"no board finished the benchmark: "
                                 f"{report['failures'][0]['error']}")
    if report["failures"]:
        return 1
    return EXIT_REGRESSION if regressed else 0


def compare_with_baseline(report: dict, baseline, max_regression: float) -> bool:
    """Each board's samples against the baseline's (kept in the report under
    ``"baseline"``); whether any board is slower beyond the threshold."""
    if baseline is None:
        return False
    named, results = baseline
    regressed = False
    for record in report["results"]:
        runs = baseline_runs(record, results)
        found = regression.compare(record["samples_s"], [s for run in runs for s in run],
                                   max_regression, baseline_runs=runs)
        record["baseline"] = {"baseline": named, **found.as_dict()}
        regressed |= found.regression
        say(f"{record['device_id']} against {named}: {found.text()}")
    return regressed


def compare_interleaved(report: dict, max_regression: float) -> bool:
    """Each board's samples against those of the --baseline-module timed in
    the same rounds (the comparison joins them under ``"baseline"``); whether
    any board is slower beyond the threshold."""
    regressed = False
    for record in report["results"]:
        measured = record["baseline"]
        found = regression.compare_rounds(record["samples_s"], measured["samples_s"],
                                          max_regression)
        named = f"{os.path.basename(measured['module']['path'])} interleaved"
        measured.update({"baseline": named, **found.as_dict()})
        regressed |= found.regression
        say(f"{record['device_id']} against {named}: {found.text()}")
    return regressed


# --baseline-module loads both modules afresh every this many rounds (interleave),
# unless their workspaces would then hold more than this in one session.
FRESH_EVERY = 5
FRESH_LOADS_BYTES = 256 << 20

# The exit status of a run that is slower than its --baseline beyond --max-regression.
EXIT_REGRESSION = 3
# How long one call on a board may take when --timeout is not given.
DEFAULT_CALL_TIMEOUT_S = 60.0


def add_farm_arguments(p, timeout_help: str) -> None:
    """Where the farm is and how long to wait on it: the same for bench and run."""
    p.add_argument("--wait", type=float, default=300.0,
                   help="seconds to wait for a free board (default 300)")
    p.add_argument("--timeout", type=float, default=None, help=timeout_help)
    p.add_argument("--tracker", help=TRACKER_HELP)
    p.add_argument("--tls-ca", default=None,
                   help="PEM certificate to trust when the farm serves TLS")


def add_arguments(p) -> None:
    p.add_argument("model", help="ONNX model (compiled for --target) or a built module .so")
    p.add_argument("--target", default=None,
                   help="preset or triple[/cpu[/features]] to compile an ONNX model for "
                        "(default: the preset that fits each leased board)")
    modelfile.add_precision_argument(p)
    p.add_argument("--key", required=True, help="device key of the boards to use")
    p.add_argument("--devices", default="1", metavar="N|all",
                   help="how many boards of the key to use at once (default 1)")
    p.add_argument("--number", type=int, default=None,
                   help="runs averaged into one sample (default 10, fewer when one run takes "
                        "long: chosen from a first timed run)")
    p.add_argument("--repeat", type=int, default=10, help="samples to take (default 10)")
    p.add_argument("--min-repeat-ms", type=float, default=0.0,
                   help="grow --number until one sample lasts at least this long")
    p.add_argument("--cooldown-ms", type=float, default=0.0, help="pause between samples")
    p.add_argument("--input-shape", action="append", default=[], metavar="NAME=D0,D1,...",
                   help="fix an ONNX input's unknown dimensions")
    modelfile.add_dynamic_argument(p)  # a dynamic module is timed at its upper bound
    p.add_argument("--no-tuning", action="store_true",
                   help="compile with the default register tiles, not those `tether tune` "
                        "cached for --target")
    p.add_argument("--json", metavar="FILE", help="write raw samples and run conditions here")
    p.add_argument("--post", metavar="URL",
                   help="post the report to a tracker's farm page (tether tracker --http), "
                        "e.g. http://farm.local:9180/ , which records it in its database "
                        "(instead of the tracker of --tracker); it is plotted there per model "
                        "and board")
    recording.add_arguments(p)
    p.add_argument("--csv", metavar="FILE", help="write one summary row per board here")
    p.add_argument("--vs", metavar="OLD.json", help="print ratios against an earlier --json")
    gate = p.add_mutually_exclusive_group()
    gate.add_argument("--baseline", metavar="NAME=VALUE|FILE.json",
                      help="compare the raw samples with a baseline's (runs recorded with that "
                           "label, or an earlier --json) and exit 3 when slower beyond "
                           "--max-regression with confidence")
    gate.add_argument("--baseline-module", metavar="OLD.so|OLD.onnx",
                      help="time this module (or model) too, in turns with MODEL on the same "
                           "board in the same session (--repeat rounds, one sample of each per "
                           "round), and exit 3 when MODEL is slower beyond --max-regression "
                           "with confidence: the gate for a machine whose speed drifts")
    p.add_argument("--max-regression", default="5%", metavar="PERCENT",
                   help="how much slower than --baseline or --baseline-module is tolerated "
                        "(default 5%%)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="write a latency plot of every board (needs matplotlib)")
    p.add_argument("--profile", action="store_true",
                   help="also time each layer (kernel call) on one thread and show the "
                        "slowest; the --json file keeps every layer")
    add_farm_arguments(p, "seconds any one call on a board may take (default 60; the "
                          "benchmark's own limit comes from a first timed run)")
