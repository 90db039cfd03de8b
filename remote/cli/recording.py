"""Keeping a ``tether bench`` or ``tether check`` report in the farm's database.

Both commands record by default when the tracker keeps a database (``--no-record``
opts out) and take ``--label NAME=VALUE`` (repeatable) to tag the run.
"""
from __future__ import annotations

import json
from typing import Callable, Dict, List, Sequence

from remote import errors
from remote.client.grpc_layer import MAX_REQUEST_BYTES
from remote.client.tracker import TrackerClient

# Room left in one call for everything but the report itself.
_ENVELOPE_BYTES = 4096


def parse_labels(specs: Sequence[str]) -> Dict[str, str]:
    """``["commit=abc", "branch=main"]`` -> ``{"commit": "abc", "branch": "main"}``."""
    labels = {}
    for spec in specs or ():
        name, sep, value = spec.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--label {spec!r} must look like NAME=VALUE, e.g. commit=abc123")
        labels[name.strip()] = value
    return labels


def add_arguments(p) -> None:
    p.add_argument("--label", action="append", default=[], metavar="NAME=VALUE",
                   help="tag the run in the farm database (repeatable), e.g. "
                        "--label commit=abc123 --label branch=main")
    p.add_argument("--no-record", action="store_true",
                   help="do not keep this run in the farm's database")


def _per_board(report: dict) -> List[dict]:
    """One report per board, each small enough for one call to the tracker (a
    board's per-layer profile is left out when it would not fit)."""
    parts = []
    for result in report["results"]:
        part = {**report, "results": [result]}
        if len(json.dumps(part, separators=(",", ":"))) + _ENVELOPE_BYTES > MAX_REQUEST_BYTES:
            part["results"] = [{k: v for k, v in result.items() if k != "profile"}]
        size = len(json.dumps(part, separators=(",", ":"))) + _ENVELOPE_BYTES
        if size > MAX_REQUEST_BYTES:
            raise ValueError(f"the result of board {result.get('device_id')} is {size} bytes, "
                             f"more than the {MAX_REQUEST_BYTES} the tracker takes in one call "
                             "(fewer --repeat samples, or --no-record and keep --json)")
        parts.append(part)
    return parts


def record_report(tracker: TrackerClient, kind: str, report: dict, labels: Dict[str, str],
                  say: Callable[[str], None]) -> List[int]:
    """Keep ``report`` in the farm's database; the records' ids, or [] (said
    why) when the tracker keeps none or cannot take it. Never raises for that:
    the run itself succeeded."""
    ids = []
    try:
        for part in _per_board(report):
            reply = tracker.record(kind, part, labels)
            ids += reply["record_ids"]
    except (errors.TetherError, ValueError) as exc:
        say(f"not recorded in the farm database: {exc}")
        return ids
    if ids:
        say(f"recorded in the farm database {reply['database']} as {kind} "
            f"#{', #'.join(str(i) for i in ids)}"
            + (f" with {', '.join(f'{k}={v}' for k, v in labels.items())}" if labels else ""))
    return ids
