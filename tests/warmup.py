"""Build what a test run will need, in the background from its start:
``python -m tests.warmup native TRIPLE...`` builds the native board server
for each triple (``module-check``: the native loader's test drivers, for all three), ``python -m tests.warmup rootfs RELEASE-ARCH...`` the
emulated boards' Debian root filesystems, one after another.

On a fresh machine zig builds a triple's C and C++ libraries the first time
(about three minutes per triple, on one core), and a root filesystem takes
minutes of downloads and unpacking. Started at a low priority when the run
begins, those builds use what the tests leave idle instead of stopping the
first test that needs each. Both builders take a lock, so a test that needs
something still being built waits for it; what this process did not finish
is built by the test.
"""
import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _stop(_signum, _frame):
    raise SystemExit(1)  # the builders then stop their tools and remove partial files


def _build(kind: str, name: str) -> str:
    if kind == "native" and name == "module-check":
        from tests.test_native_loader import build_drivers
        return " ".join(build_drivers().values())
    if kind == "native":
        from remote.cli.native import build_native
        return build_native(name)
    from deploy_recipes import emulate
    release, arch = name.split("-", 1)
    return emulate.build_rootfs(release, arch)


def main(kind: str, names) -> int:
    signal.signal(signal.SIGTERM, _stop)
    for name in names:
        try:
            print(_build(kind, name), flush=True)
        except Exception as exc:  # noqa: BLE001 - the test that needs it reports it
            print(f"{name}: {exc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
