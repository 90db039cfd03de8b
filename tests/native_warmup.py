"""Build the native board server for the given triples, one after another, in
the background of a test run: ``python -m tests.native_warmup TRIPLE...``.

zig builds a triple's C and C++ libraries the first time (on a fresh machine
about three minutes per triple, on one core). Started when the run begins, at a
low priority, those builds use the core the tests leave idle instead of
stopping the first test that needs each server. build_native's lock makes a
test that needs a triple still being built wait for it; a build this process
did not finish is redone by the test.
"""
import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _stop(_signum, _frame):
    raise SystemExit(1)  # build_native then kills zig and removes its partial file


def main(triples) -> int:
    from remote.cli.native import NativeBuildError, build_native
    signal.signal(signal.SIGTERM, _stop)
    for triple in triples:
        try:
            print(build_native(triple), flush=True)
        except NativeBuildError as exc:  # the test that needs it reports it
            print(f"{triple}: {exc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
