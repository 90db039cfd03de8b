"""How sessions, modules, benchmark results and the pool look to a person:
plain-text tables for the terminal and ``print``, HTML tables for Jupyter.

Pure functions over the objects' data; nothing here talks to a board.

>>> res = mod.benchmark(number=10, repeat=5)      # doctest: +SKIP
>>> print(res)                                    # the text table  # doctest: +SKIP
>>> res                                           # in Jupyter: the HTML table  # doctest: +SKIP
"""
from __future__ import annotations

import html
import time
from typing import List, Sequence, Tuple

Rows = Sequence[Tuple[object, ...]]

# Benchmark statistics in the order every table shows them.
STATS = ("mean", "median", "p90", "p99", "std", "min", "max")


def ms(seconds: float) -> str:
    """A time in the unit a person reads it in, four significant figures:
    12.34 µs under a millisecond, 12.34 ms under ten seconds, 12.34 s beyond
    (never 1.017e+04 ms).

    >>> ms(0.00001234), ms(0.01234), ms(10.17), ms(0)
    ('12.34 µs', '12.34 ms', '10.17 s', '0 ms')
    """
    if seconds == 0:
        return "0 ms"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.4g} µs"
    if seconds >= 1000:
        return f"{seconds:.0f} s"
    if seconds >= 10:
        return f"{seconds:.4g} s"
    return f"{seconds * 1e3:.4g} ms"


def size(n_bytes: int) -> str:
    """Bytes for people: 512 B, 3.4 KiB, 45.2 MiB, 1.5 GiB."""
    if not n_bytes:
        return "-"
    value = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


# ------------------------------------------------------------ renderers --
def text_table(headers: Sequence[str], rows: Rows) -> str:
    """Columns padded to their widest cell, two spaces apart; no header line when
    every header is empty (name/value lists). Control characters in a cell are
    shown escaped: cells hold what boards and clients sent (keys, attributes),
    and a terminal would obey an escape sequence among them."""
    lines = [tuple(headers), *rows] if any(headers) else list(rows)
    lines = [tuple(_terminal_safe(str(x)) for x in row) for row in lines]
    widths = [max(len(str(x)) for x in col) for col in zip(*lines)]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip()
                     for row in lines)


def _terminal_safe(text: str) -> str:
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def html_table(headers: Sequence[str], rows: Rows, caption: str = "") -> str:
    """A plain HTML table; every cell is escaped."""
    out = ["<table>"]
    if caption:
        out.append(f"<caption>{html.escape(caption)}</caption>")
    out.append("<thead><tr>" + "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
               + "</tr></thead><tbody>")
    for row in rows:
        out.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def error_html(message: str) -> str:
    return f"<p><b>error:</b> {html.escape(message)}</p>"


# -------------------------------------------------------------- session --
def board_cpu(info: dict) -> str:
    """A board's CPU as a person should read it: an emulated board reports the
    host's CPU name through qemu, so it says it is emulated, and by what, instead.

    >>> board_cpu({"cpu_model": "Intel Xeon", "emulated": "qemu-aarch64 -cpu cortex-a72"})
    'emulated by qemu-aarch64 -cpu cortex-a72'
    """
    if info.get("emulated"):
        return f"emulated by {info['emulated']}"
    return info.get("cpu_model") or "?"


def _device_rows(info: dict) -> List[Tuple[str, str]]:
    memory = size(info.get("memory_bytes", 0))
    return [
        ("triple", info.get("triple") or "?"),
        ("cpu", board_cpu(info)),
        ("cores", str(info.get("cores", "?"))),
        ("memory", memory),
        ("os", info.get("os") or "?"),
        ("python", info.get("python") or "?"),
        ("numpy", info.get("numpy") or "?"),
        ("server", info.get("server_version") or "?"),
    ]


def _session_rows(sess) -> List[Tuple[str, str]]:
    rows = [("address", sess.address), ("session", sess.session_id),
            ("state", "closed" if sess.closed else "open")]
    return rows + _device_rows(sess.device_info())


def session_text(sess) -> str:
    return f"Session on {sess.address}\n" + text_table(("", ""), _session_rows(sess))


def session_html(sess) -> str:
    return html_table(("", ""), _session_rows(sess), caption=f"Session on {sess.address}")


# --------------------------------------------------------------- module --
def _tensor_rows(module) -> List[Tuple[str, str, str, str]]:
    rows = []
    for kind in ("inputs", "outputs"):
        for t in module.metadata.get(kind, ()):
            rows.append((kind[:-1], t["name"], t["dtype"], "x".join(map(str, t["shape"]))))
    return rows


def _module_caption(module) -> str:
    target = module.metadata.get("target", {})
    where = target.get("name") or target.get("triple") or "?"
    return (f"RemoteModule {module.module_id} on {module.session.address} "
            f"(built for {where}, loaded in {ms(module.load_s)})")


def module_text(module) -> str:
    return _module_caption(module) + "\n" + text_table(
        ("", "NAME", "DTYPE", "SHAPE"), _tensor_rows(module))


def module_html(module) -> str:
    return html_table(("", "name", "dtype", "shape"), _tensor_rows(module),
                      caption=_module_caption(module))


# ------------------------------------------------------------ benchmark --
def benchmark_rows(result) -> List[Tuple[str, str]]:
    rows = [(name, ms(getattr(result, name))) for name in STATS]
    rows.append(("load", ms(result.load_s)))
    rows.append(("peak memory", size(getattr(result, "peak_rss_bytes", 0))))
    rows.append(("runs", f"{result.repeat} x {result.number}"))
    rows.append(("threads", threads(getattr(result, "threads", 0))))
    return rows


def threads(count: int) -> str:
    """Threads per run as results show them; 0 is a board that did not say."""
    return str(count) if count else "not reported"


def benchmark_text(result) -> str:
    return "BenchmarkResult\n" + text_table(("", ""), benchmark_rows(result))


def benchmark_html(result) -> str:
    return html_table(("statistic", "value"), benchmark_rows(result),
                      caption=f"Benchmark: {result.repeat} samples of {result.number} runs")


# -------------------------------------------------------------- profile --
PROFILE_HEADERS = ("OP", "NAME", "FUSED", "INPUTS", "OUTPUTS", "TIME", "SHARE")


def shapes(shape_list) -> str:
    """[[1, 3, 8, 8], [4]] -> '1x3x8x8, 4'."""
    return ", ".join("x".join(map(str, s)) for s in shape_list) or "-"


def profile_rows(rows, limit: int = 0) -> List[Tuple[str, ...]]:
    """Cells of per-step profile rows (as given, at most ``limit`` when set)."""
    chosen = list(rows)[:limit] if limit else list(rows)
    return [(r["op"], r["name"], "+".join(r.get("fused", ())) or "-", shapes(r.get("inputs", ())),
             shapes(r.get("outputs", ())), ms(r["mean_s"]), f"{r['share'] * 100:.1f}%")
            for r in chosen]


def profile_text(result) -> str:
    return (f"ProfileResult: {len(result.rows)} steps, {ms(result.total_s)} per run "
            f"(mean of {result.number})\n" + text_table(PROFILE_HEADERS, profile_rows(result.rows)))


def profile_html(result) -> str:
    return html_table([h.lower() for h in PROFILE_HEADERS], profile_rows(result.rows),
                      caption=f"Per-step times: {ms(result.total_s)} per run, "
                              f"mean of {result.number}")


# ----------------------------------------------------------------- pool --
def _since(unix_time: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(unix_time))


def _capabilities(d: dict) -> str:
    parts = [d["triple"] or "?", board_cpu(d), f"{d['cores']} cores"]
    if d["memory_bytes"]:
        parts.append(f"{d['memory_bytes'] / 2**30:.1f} GiB")
    if d["os"]:
        parts.append(d["os"])
    parts += [f"{k}={v}" for k, v in sorted(d["attributes"].items())]
    return ", ".join(parts)


def _where(device: dict) -> str:
    """A board's address, marked when its sessions go through the tracker."""
    if device.get("relayed"):
        return f"{device['address']} (relay)".strip()
    return device["address"]


def summary_text(data: dict) -> str:
    """``TrackerClient.summary()`` as text tables (what ``tether status`` prints)."""
    out = [f"tracker {data['tracker']}", ""]
    if data["keys"]:
        out.append(text_table(("KEY", "TOTAL", "FREE", "PENDING"),
                              [(k["key"], k["total"], k["free"], k["pending"])
                               for k in data["keys"]]))
    else:
        out.append("no devices registered")
    if data["devices"]:
        out += ["", text_table(
            ("DEVICE", "KEY", "ADDRESS", "STATE", "HOLDER", "SINCE", "CAPABILITIES"),
            [(d["device_id"], d["key"], _where(d), d["state"], d["holder"] or "-",
              f"{_since(d['held_since'])} ({d['held_s']:.0f}s)" if d["holder"] else "-",
              _capabilities(d)) for d in data["devices"]])]
    if data["waiting"]:
        out += ["", "queue, in the order it will be served:", text_table(
            ("#", "KEY", "PRIORITY", "CLIENT", "WAITED"),
            [(i + 1, w["key"], w["priority"], w["client"], f"{w['waited_s']:.1f}s")
             for i, w in enumerate(data["waiting"])])]
    else:
        out += ["", "queue: empty"]
    return "\n".join(out)


def _device_cells(d: dict) -> Tuple[str, ...]:
    held = f"{_since(d['held_since'])} ({d['held_s']:.0f}s)" if d.get("holder") else "-"
    return (d["device_id"], d["key"], _where(d), d["state"], d.get("holder") or "-", held,
            d.get("triple") or "?", str(d.get("cores", "?")), size(d.get("memory_bytes", 0)))


def summary_html(data: dict) -> str:
    """``TrackerClient.summary()`` as three HTML tables: keys, devices, queue."""
    parts = [f"<p>tracker {html.escape(data['tracker'])}</p>"]
    parts.append(html_table(("key", "total", "free", "pending"),
                            [(k["key"], k["total"], k["free"], k["pending"])
                             for k in data["keys"]], caption="keys"))
    parts.append(html_table(("device", "key", "address", "state", "holder", "since", "triple",
                             "cores", "memory"),
                            [_device_cells(d) for d in data["devices"]], caption="devices"))
    parts.append(html_table(("#", "key", "priority", "client", "waited"),
                            [(i + 1, w["key"], w["priority"], w["client"],
                              f"{w['waited_s']:.1f}s") for i, w in enumerate(data["waiting"])],
                            caption="queue, in the order it will be served"))
    return "".join(parts)


class PoolSummary(dict):
    """The tracker's summary: plain JSON-ready data that prints as tables.

    >>> tracker.summary()["keys"]       # doctest: +SKIP
    >>> print(tracker.summary())        # the tables ``tether status`` shows  # doctest: +SKIP
    """

    def __str__(self) -> str:
        return summary_text(self)

    def _repr_html_(self) -> str:
        return summary_html(self)
