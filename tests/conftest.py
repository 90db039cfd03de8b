import os
import signal
import subprocess
import sys

import pytest


def pytest_configure(config):
    # A run started in the background by a non-interactive shell (`bash tests/run.sh &`,
    # as some CI runners do) inherits SIGINT ignored, and so would every command the
    # tests start: the tests that press Ctrl-C on a command, or on this process as
    # Jupyter does, then wait in vain. Take Ctrl-C back, as at a terminal.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="module")
def farm():
    """A real tracker and one real device server (key "host") as child processes."""
    from remote.cli.localfarm import LocalFarm
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with LocalFarm(keys=["host"], env=env) as running:
        yield running


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """A real sshd on 127.0.0.1 standing for a board (tests/ssh_board.py)."""
    import shutil

    from tests.ssh_board import SSHD, SSHServer
    if SSHD is None or shutil.which("ssh-keygen") is None:
        pytest.skip("the bootstrap tests need OpenSSH: apt-get install openssh-server "
                    "openssh-client")
    server = SSHServer(tmp_path_factory.mktemp("sshd")).start()
    yield server
    server.stop()


@pytest.fixture
def stop_leftover_server(tmp_path):
    """Stops the server a failed bootstrap test left running on the "board" (installed
    with --remote-dir TMP_PATH/board-home/.tether)."""
    yield
    pid_file = tmp_path / "board-home" / ".tether" / "server.pid"
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text()), 15)
        except (ProcessLookupError, ValueError):
            pass


@pytest.fixture(scope="session")
def mlp_module(tmp_path_factory):
    """(onnx model path, compiled host .so path) of the test MLP."""
    import onnx

    import crosscompile
    from tests.onnx_models import mlp
    folder = tmp_path_factory.mktemp("mlp")
    model_path = str(folder / "mlp.onnx")
    onnx.save(mlp(), model_path)
    so_path = str(folder / "mlp.so")
    crosscompile.build(model_path, target="host").export_library(so_path)
    return model_path, so_path


def pytest_addoption(parser):
    parser.addoption("--full-zoo", action="store_true",
                     help="also run every model of the emulated model zoo (tests marked full_zoo; "
                          "about 10 more minutes on 2 cores)")
    parser.addoption("--node-suite", action="store_true",
                     help="also run all 2,001 onnx backend node cases (tests marked node_suite; "
                          "tens of minutes on 2 cores)")


# Markers of tests left out of the default run, unless a -m expression names them.
OPT_IN_MARKERS = ("quantized_forms", "quantized_zoo", "more_systems", "peer_tools")


def pytest_collection_modifyitems(config, items):
    """Leave the full emulated model zoo out unless --full-zoo is given, the
    full onnx node-suite sweep unless --node-suite is, and the tests marked
    with an OPT_IN_MARKERS marker unless `-m` names it.

    They are reported as deselected, not skipped: the default run keeps one
    representative model per emulated architecture and a sample of the
    node cases. A system of more_systems also runs when `-m` names its own
    mark (e.g. `-m bullseye_arm64`).
    """
    wanted = config.getoption("-m") or ""
    left_out = [m for m in OPT_IN_MARKERS if m not in wanted]
    left_out += [marker for marker, option in (("full_zoo", "--full-zoo"),
                                               ("node_suite", "--node-suite"))
                 if not config.getoption(option)]
    kept, left = [], []
    for item in items:
        named = item.get_closest_marker("more_systems") is not None and any(
            mark.name in wanted for mark in item.iter_markers()
            if mark.name.endswith(("_arm64", "_armhf")))
        out = any(item.get_closest_marker(m) for m in left_out)
        (left if out and not named else kept).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
    items[:] = builds_last(kept) if len(kept) >= WARMUP_MIN_ITEMS else kept
    _start_warmups(config, items)


X86_TRIPLE = "x86_64-linux-musl"
ARM_TRIPLES = (("aarch64-linux-musl", ("aarch64", "arm64")),
               ("arm-linux-musleabihf", ("armv7", "armhf")))


def item_triples(item):
    """The native server's triples a test uses: x86_64 for every native server
    test, the ARM ones where its name says so (and all three for the native
    tool tests, which build every one)."""
    name = item.nodeid
    if "native" not in name:
        return []
    every = "test_native_" in name
    return [X86_TRIPLE] + [triple for triple, words in ARM_TRIPLES
                           if every or any(w in name for w in words)]


def item_systems(item):
    """The emulated Debian systems (RELEASE-ARCH) a test uses: bookworm's for
    every emulated test (its arm64 one, and its armhf one where the test names
    32-bit ARM), or those its system marks name."""
    if item.get_closest_marker("emulated") is None:
        return []
    systems = [m.name.replace("_", "-") for m in item.iter_markers()
               if m.name.endswith(("_arm64", "_armhf"))]
    return systems or ["bookworm-armhf" if any(w in item.nodeid for w in ("armhf", "armv7", "rasp3b"))
                       else "bookworm-arm64"]


def _in_order_of_need(items, needs):
    wanted = []
    for item in items:
        wanted += [n for n in needs(item) if n not in wanted]
    return wanted


def native_triples(items):
    """The native server's triples the selected tests use, in the order they
    first need them; then the native loader's drivers if its tests run."""
    wanted = _in_order_of_need(items, item_triples)
    if any(item.nodeid.startswith("tests/test_native_loader.py") for item in items):
        wanted.append("module-check")
    return wanted


def emulated_systems(items):
    """The emulated Debian systems the selected tests use, in the order they first need them."""
    return _in_order_of_need(items, item_systems)


def builds_last(items):
    """The items, each test module kept whole, with the modules that need
    nothing built first, then those that need the x86_64 native server, then
    those that need an ARM one or an emulated system: the warm-ups build those
    while the tests that need none of it run, instead of a test early in the
    alphabet waiting minutes for them."""
    modules = {}
    for item in items:
        need = 0
        if item_systems(item) or any(t != X86_TRIPLE for t in item_triples(item)):
            need = 2
        elif item_triples(item):
            need = 1
        key = item.nodeid.split("::")[0]
        modules[key] = max(modules.get(key, 0), need)
    order = {key: rank for rank, key in enumerate(modules)}
    return sorted(items, key=lambda item: (modules[item.nodeid.split("::")[0]],
                                           order[item.nodeid.split("::")[0]]))


# A run of fewer tests builds what it needs on demand, in the order given.
WARMUP_MIN_ITEMS = 50


def _start_warmups(config, items):
    """Builds of the native servers and root filesystems the run needs, each kind
    in a background process of its own (tests/warmup.py); a run of a few tests
    builds on demand."""
    config._warmups = []
    if len(items) < WARMUP_MIN_ITEMS:
        return
    for kind, names in (("native", native_triples(items)), ("rootfs", emulated_systems(items))):
        if names:
            config._warmups.append(subprocess.Popen(
                [sys.executable, "-m", "tests.warmup", kind, *names], cwd=ROOT,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=lambda: os.nice(10)))


def pytest_unconfigure(config):
    """Stop what the warm-ups still build: each one's process group (its tools too)."""
    warmups = getattr(config, "_warmups", [])
    for proc in warmups:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
    for proc in warmups:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        _signal_group(proc, signal.SIGKILL)  # a tool that outlived its builder


def _signal_group(proc, signum):
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass
