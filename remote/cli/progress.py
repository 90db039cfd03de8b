"""Progress a person can see, for the ``progress=`` callbacks of the library.

tqdm draws the bars when it is installed (the ``notebook`` extra:
``bash deploy_recipes/venv.sh notebook`` in a checkout, or ``pip install tqdm``;
in Jupyter it draws widgets); otherwise a plain bar goes to stderr. Host side
only: the library itself never prints.

>>> from remote.cli.progress import bar
>>> sess.upload("net.so", progress=bar("upload net.so"))     # doctest: +SKIP
"""
from __future__ import annotations

import re
import sys
import threading
import time
from contextlib import contextmanager

try:  # optional extra
    from tqdm.auto import tqdm as _tqdm
except ImportError:  # pragma: no cover - depends on what is installed
    _tqdm = None

_PRINT_LOCK = threading.Lock()
# A plain bar that is not on a terminal redraws at most this often.
_PLAIN_INTERVAL_S = 0.5


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def say(message: str, stream=None) -> None:
    """One line on stderr, whole even when several threads report at once."""
    stream = stream or sys.stderr
    with _PRINT_LOCK:
        stream.write(message + "\n")
        stream.flush()


class ByteBar:
    """A ``progress(done, total)`` callback that draws a bar of bytes."""

    def __init__(self, label: str, position: int = 0, stream=None, use_tqdm=None):
        self.label = label
        self.stream = stream or sys.stderr
        self.position = position
        if use_tqdm is None:
            # tqdm on a terminal or in Jupyter; CI logs read better with plain lines.
            use_tqdm = _tqdm is not None and (_isatty(self.stream) or "ipykernel" in sys.modules)
        self._use_tqdm = use_tqdm
        self._bar = None
        self._last = 0.0
        self._done = False
        self._start = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        if self._done:
            return
        if self._use_tqdm:
            if self._bar is None:
                self._bar = _tqdm(total=total, desc=self.label, unit="B", unit_scale=True,
                                  unit_divisor=1024, position=self.position, leave=True,
                                  file=self.stream)
            self._bar.update(done - self._bar.n)
            if done >= total:
                self.close()
            return
        now = time.monotonic()
        finished = done >= total
        if not finished and now - self._last < _PLAIN_INTERVAL_S:
            return
        self._last = now
        width = 24
        filled = width * done // max(total, 1)
        line = (f"{self.label} [{'#' * filled}{'.' * (width - filled)}] "
                f"{done / 2**20:.1f}/{total / 2**20:.1f} MiB")
        if finished:
            line += f" in {now - self._start:.2f} s"
            self._done = True
        say(line, self.stream)

    def close(self) -> None:
        self._done = True
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def bar(label: str, position: int = 0) -> ByteBar:
    """A progress callback for ``upload``/``download``/``upload_tensor``."""
    return ByteBar(label, position)


class Ticker:
    """A line that says what a long step is doing and for how long.

    On a terminal it is redrawn in place every quarter second (``label: detail
    12 s``); piped, it writes the start line and the end line only, so logs stay
    short. ``update(detail)`` changes what it says; ``step(what, done, total)`` is
    the library's ``progress=`` callback for steps that count their work.

    >>> with Ticker("compiling resnet50.onnx for rasp4b64") as tick:   # doctest: +SKIP
    ...     lib = crosscompile.build("resnet50.onnx", "rasp4b64", progress=tick.step)
    """

    INTERVAL_S = 0.25
    _drawing = set()  # live tickers now on the screen: one line can tick at a time

    def __init__(self, label: str, stream=None, live=None):
        self.label = label
        self.stream = stream or sys.stderr
        self.live = _isatty(self.stream) if live is None else live
        self.detail = ""
        self._what = None
        self._start = time.monotonic()
        self._stop = threading.Event()
        self._thread = None

    def update(self, detail: str) -> None:
        self.detail = detail

    def step(self, what: str, done: int, total: int) -> None:
        new_step = what != self._what
        self._what = what
        self.detail = f"{what} {done}/{total}" if total > 1 else what
        if new_step and self._thread is not None:
            self._draw()  # every step is seen once, however quickly it passes

    def elapsed(self) -> float:
        return time.monotonic() - self._start

    def _line(self) -> str:
        detail = f": {self.detail}" if self.detail else " ..."
        return f"{self.label}{detail} [{self.elapsed():.0f} s]"

    def _draw(self) -> None:
        with _PRINT_LOCK:
            # \r and clear-to-end: the line is redrawn in place, shorter or longer.
            self.stream.write("\r" + self._line() + "\x1b[K")
            self.stream.flush()

    def _tick(self) -> None:
        while not self._stop.wait(self.INTERVAL_S):
            self._draw()

    def __enter__(self) -> "Ticker":
        self._start = time.monotonic()
        with _PRINT_LOCK:
            # A second line at once (boards benchmarked side by side) prints plainly.
            self.live = self.live and not Ticker._drawing
            if self.live:
                Ticker._drawing.add(self)
        if self.live:
            self._draw()
            self._thread = threading.Thread(target=self._tick, name="ticker", daemon=True)
            self._thread.start()
        else:
            say(f"{self.label} ...", self.stream)
        return self

    def __exit__(self, kind, _value, _tb) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            with _PRINT_LOCK:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
                Ticker._drawing.discard(self)
        if kind is None:
            say(f"{self.label}: done in {self.elapsed():.2f} s", self.stream)
        elif self.live:
            say(f"{self.label}: stopped after {self.elapsed():.2f} s", self.stream)


@contextmanager
def stage(label: str, stream=None):
    """Announce a step that reports no progress of its own, then its duration;
    on a terminal the line ticks while the step runs (see Ticker).

    >>> with stage("compiling mlp.onnx for rasp4b64"):      # doctest: +SKIP
    ...     lib = crosscompile.build("mlp.onnx", "rasp4b64")
    """
    with Ticker(label, stream) as ticker:
        yield ticker


_COUNTED = re.compile(r"^(?P<what>.*\S) (?P<done>\d+)/(?P<total>\d+)$")


class Steps:
    """A ``progress(message)`` callback for a run of steps that say what they do.

    On a terminal the current step's line ticks with its elapsed time until the
    next message; piped, each message is one line. A message ending in a count
    (``"unpacking packages 7/117"``) that repeats the current step's words moves
    that step on: on a terminal the same line is redrawn, piped only the first
    and the last count are written.

    >>> board = EmulatedBoard("bookworm", "arm64", progress=Steps())   # doctest: +SKIP
    """

    def __init__(self, stream=None, live=None):
        self.stream = stream or sys.stderr
        self.live = _isatty(self.stream) if live is None else live
        self._ticker = None
        self._what = None

    def __call__(self, message: str) -> None:
        counted = _COUNTED.match(message)
        what = counted.group("what") if counted else None
        if counted and what == self._what:
            last = counted.group("done") == counted.group("total")
            if self._ticker is not None:
                self._ticker.update(f"{counted.group('done')}/{counted.group('total')}")
            elif last:
                say(message, self.stream)
            return
        self.close()
        self._what = what
        if not self.live:
            say(message, self.stream)
            return
        label, detail = (what, f"{counted.group('done')}/{counted.group('total')}") \
            if counted else (message, "")
        self._ticker = Ticker(label, self.stream, live=True)
        self._ticker.update(detail)
        self._ticker.__enter__()

    def close(self) -> None:
        """End the current step's line (a later message starts a new one)."""
        ticker, self._ticker = self._ticker, None
        if ticker is not None:
            ticker.__exit__(None, None, None)
