"""``tether history``: a model's benchmarks on each key over time, from the farm database.

One table per model and key, oldest run first: when, which board, the median
and minimum per-run time, the samples, the labels, the ratio to the run before
it on the same board, and REGRESSION where that run is slower than the one
before beyond ``--max-regression`` with confidence (remote/regression.py).
``--json`` prints the records with those marks; ``--plot FILE.png`` draws the
medians over time, one line per board, regressions circled in red.
``--checks`` shows the recorded accuracy checks (``tether check``) instead.
"""
from __future__ import annotations

import datetime
import json
import os
from typing import Dict, List, Tuple

from remote import regression
from remote.cli.recording import parse_labels
from remote.client import display
from remote.client.tracker import TrackerClient


def group(records: List[dict]) -> Dict[Tuple[str, str], List[dict]]:
    """Records by (model name, key), each list oldest first."""
    groups: Dict[Tuple[str, str], List[dict]] = {}
    for record in records:
        groups.setdefault((record["model_name"], record["key"]), []).append(record)
    return groups


def when(record: dict) -> str:
    return datetime.datetime.fromtimestamp(record["recorded_at"]).strftime("%Y-%m-%d %H:%M:%S")


def table(records: List[dict], marks: Dict[int, dict]) -> str:
    rows, last = [], {}
    for r in records:
        before = last.get(r["device_id"])
        last[r["device_id"]] = r
        ratio = f"{r['median_s'] / before['median_s']:.3f}x" if before else "-"
        rows.append((when(r), r["device_id"], display.ms(r["median_s"]),
                     display.ms(min(r["samples_s"])), len(r["samples_s"]),
                     " ".join(f"{k}={v}" for k, v in sorted(r["labels"].items())) or "-",
                     ratio, "REGRESSION" if r["id"] in marks else ""))
    return display.text_table(("WHEN", "BOARD", "MEDIAN", "MIN", "SAMPLES", "LABELS",
                               "VS BEFORE", ""), rows)


def checks_table(records: List[dict]) -> str:
    def worst(record, name, pick):
        values = [o[name] for o in record["outputs"] if o.get(name) is not None]
        return pick(values) if values else None

    rows = []
    for r in records:
        max_abs, cosine = worst(r, "max_abs", max), worst(r, "cosine", min)
        top1 = worst(r, "top1", min)
        rows.append((when(r), r["device_id"], "ok" if r["passed"] else "BEYOND",
                     "-" if max_abs is None else f"{max_abs:.3g}",
                     "-" if cosine is None else f"{cosine:.6f}",
                     "-" if top1 is None else f"{top1:.1%}", (r["inputs"] or {}).get("count", "-"),
                     " ".join(f"{k}={v}" for k, v in sorted(r["labels"].items())) or "-"))
    return display.text_table(("WHEN", "BOARD", "VERDICT", "MAX ABS", "COSINE", "TOP-1",
                               "INPUTS", "LABELS"), rows)


def write_plot(path: str, groups: Dict[Tuple[str, str], List[dict]],
               marks: Dict[int, dict]) -> None:
    from remote.cli.bench import _matplotlib

    plt = _matplotlib()
    fig, axes = plt.subplots(len(groups), 1, figsize=(8, 3 * len(groups)), squeeze=False)
    for ax, ((model, key), records) in zip(axes[:, 0], sorted(groups.items())):
        for board in sorted({r["device_id"] for r in records}):
            mine = [r for r in records if r["device_id"] == board]
            times = [datetime.datetime.fromtimestamp(r["recorded_at"]) for r in mine]
            ax.plot(times, [r["median_s"] * 1e3 for r in mine], marker="o", label=board)
            bad = [(t, r["median_s"] * 1e3) for t, r in zip(times, mine) if r["id"] in marks]
            if bad:
                ax.scatter(*zip(*bad), s=160, facecolors="none", edgecolors="red",
                           linewidths=2, zorder=3)
        ax.set_title(f"{model} on {key}")
        ax.set_ylabel("median per run (ms)")
        ax.legend(fontsize="small")
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_history(args, tracker_address) -> int:
    threshold = regression.parse_threshold(args.max_regression)
    labels = parse_labels(args.label)
    if args.plot:
        from remote.cli.bench import _matplotlib
        _matplotlib()  # says what to install before anything is fetched
    kind = "check" if args.checks else "bench"
    if args.checks and args.plot:
        raise ValueError("--plot draws benchmarks; leave out --checks to plot")
    with TrackerClient(*tracker_address, tls_ca=args.tls_ca) as tracker:
        records = tracker.results(kind, model=os.path.basename(args.model or ""),
                                  key=args.key or "", labels=labels, limit=args.last)
    groups = group(records)
    if args.checks:
        if args.json:
            print(json.dumps(records, indent=2))
        for (model, key), records_of in ([] if args.json else sorted(groups.items())):
            print(f"{model} on key {key}: {len(records_of)} check(s)")
            print("\n".join("  " + line for line in checks_table(records_of).splitlines()))
            print()
        if not groups and not args.json:
            print("no accuracy checks recorded")
        return 0
    marks = {}
    for records_of in groups.values():
        marks.update(regression.mark_regressions(records_of, threshold))
    if args.json:
        for record in records:
            record["regression"] = marks.get(record["id"])
        print(json.dumps(records, indent=2))
    elif not groups:
        print("no benchmarks recorded" + (f" of {args.model}" if args.model else "")
              + (f" on key {args.key!r}" if args.key else "")
              + (" with " + ", ".join(f"{k}={v}" for k, v in labels.items()) if labels else ""))
    else:
        for (model, key), records_of in sorted(groups.items()):
            print(f"{model} on key {key}: {len(records_of)} run(s)")
            print("\n".join("  " + line for line in table(records_of, marks).splitlines()))
            print()
    if args.plot and groups:
        write_plot(args.plot, groups, marks)
        from remote.cli.progress import say
        say(f"wrote {args.plot}")
    return 0


def add_arguments(p) -> None:
    p.add_argument("model", nargs="?", default="",
                   help="model file (or its name, or its or its module's sha256); "
                        "default: every model")
    p.add_argument("--key", default="", help="device key (default: every key)")
    p.add_argument("--label", action="append", default=[], metavar="NAME=VALUE",
                   help="only runs carrying this label (repeatable)")
    p.add_argument("--last", type=int, default=0, metavar="N", help="only the newest N runs")
    p.add_argument("--max-regression", default="5%", metavar="PERCENT",
                   help="mark a run slower than the one before it beyond this "
                        "(default 5%%)")
    p.add_argument("--checks", action="store_true",
                   help="show the recorded accuracy checks (tether check) instead")
    p.add_argument("--json", action="store_true", help="print the records as JSON")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw the medians over time (needs matplotlib)")
    p.add_argument("--tracker", help="HOST:PORT (default $TETHER_TRACKER)")
    p.add_argument("--tls-ca", default=None,
                   help="PEM certificate to trust when the farm serves TLS")
