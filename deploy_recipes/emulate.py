"""Emulated ARM boards: a Debian root filesystem run under qemu user-mode emulation.

A root filesystem holds one Debian release's own python3, python3-numpy and
python3-protobuf for arm64 or armhf, as Raspberry Pi OS of
that generation ships them. It is built once with ``debootstrap --foreign``
(which only downloads and unpacks, needing no emulator) plus ``dpkg-deb -x`` of
the downloaded packages, and cached under ``$TETHER_CACHE/rootfs`` (default
``~/.cache/tether/rootfs``). The device server then runs inside it with
``qemu-aarch64``/``qemu-arm -L ROOTFS``: every system call is the host's, so the
board listens on, and dials, the host's own network. Where a Debian package
cannot work as shipped (GUEST_FIXES), a small preload library built with the
host's cross compiler goes into that root filesystem.

    >>> board = EmulatedBoard("bookworm", "arm64")                       # doctest: +SKIP
    >>> board.start(tracker="127.0.0.1:9190", key="qemu-arm64")          # doctest: +SKIP
    >>> board.stop()                                                     # doctest: +SKIP
"""
from __future__ import annotations

import fcntl
import glob
import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

from deploy_recipes.devicecode import PROJECT_ROOT, copy_device_files
from remote.defaults import (DEBIAN_MIRROR_ENV, EMULATED_ENV, FARM_SECRET_ENV, cache_dir,
                             default_tracker)
from remote.errors import TetherError

RELEASES = ("bullseye", "bookworm", "trixie")
PACKAGES = ("python3", "python3-numpy", "python3-protobuf")
# Dependencies debootstrap's simple resolver misses, by release.
EXTRA_PACKAGES = {}
# Bump when the way a root filesystem is made changes, so caches are rebuilt.
ROOTFS_FORMAT = 2
# Debian packages that fail as shipped, worked around by a preload library the
# guest's dynamic loader loads into every process (listed in the root
# filesystem's /etc/ld.so.preload). (release, arch): (C source in
# deploy_recipes/, why). Delete an entry once Debian fixes its package.
# (Boards used to need trixie armhf's grpcio mended here; board protocol v2
# needs no grpcio, and a root filesystem that still lists that fix drops it.)
GUEST_FIXES = {}
# Where the fix libraries (and a copy of their source) live inside the root filesystem.
FIX_DIR = "/usr/local/lib/tether"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# Debian mirrors now and then serve a half-synced index ("Packages.gz was
# corrupt") or stop answering for a while; a later attempt usually gets through.
# debootstrap cannot resume, so each attempt starts from an empty folder.
MIRROR_ATTEMPTS = 3
# Names a Debian mirror also serves releases under (see _build_suites).
SUITE_ALIASES = ("stable", "oldstable", "oldoldstable", "testing")
MIRROR_RETRY_DELAY_S = 15.0  # times the attempt number
# What debootstrap prints when the mirror, not this machine, is at fault, most
# telling first (wget timeouts end as "Failed getting release file" or "Couldn't
# download").
MIRROR_FAILURES = ("was corrupt", "Failed getting release", "Couldn't download",
                   "Error executing gpgv to check Release signature", "Invalid Release file")
# wget's own defaults wait 15 minutes for a silent mirror and try 20 times.
WGET_SETTINGS = "timeout = 60\ntries = 2\n"
# Only a hang ends the wait: a server that exits while starting is noticed at
# once, and a loaded machine may take minutes to start one under emulation.
STARTUP_TIMEOUT_S = 600.0
# Where the device-side code lives inside the root filesystem.
CODE_DIR = "/opt/tether"


class Arch(NamedTuple):
    debian: str      # Debian architecture name
    qemu: str        # qemu user-mode emulator
    multiarch: str   # /usr/lib/<multiarch> inside the root filesystem
    cpu: str         # qemu -cpu: what the boards of this arch can run
    machine: str     # what platform.machine() reports on the board


ARCHES: Dict[str, Arch] = {
    # "max" runs every instruction a Pi 4/5 has (cortex-a72/a76 code).
    "arm64": Arch("arm64", "qemu-aarch64", "aarch64-linux-gnu", "max", "aarch64"),
    # Pi 3/4 under 32-bit Raspberry Pi OS: ARMv8 cores in AArch32 state, NEON and VFPv4.
    "armhf": Arch("armhf", "qemu-arm", "arm-linux-gnueabihf", "max", "armv7l"),
}

Progress = Optional[Callable[[str], None]]


class EmulationError(TetherError):
    """The emulated board cannot be built or started; the message says what to do."""


class MirrorError(EmulationError):
    """The Debian mirror served a broken index or did not answer, attempt after attempt."""


class _CommandFailed(EmulationError):
    def __init__(self, message: str, output: str):
        super().__init__(message)
        self.output = output


def rootfs_path(release: str, arch: str) -> str:
    return os.path.join(cache_dir(), "rootfs", f"{release}-{arch}")


def _check(release: str, arch: str) -> Arch:
    if release not in RELEASES:
        raise ValueError(f"unknown Debian release {release!r}; choose one of {', '.join(RELEASES)}")
    if arch not in ARCHES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHES)}")
    return ARCHES[arch]


def missing_tools(arch: str = "arm64", release: Optional[str] = None) -> List[str]:
    """Debian packages to install before boards of ``arch`` can be built and run.

    Without ``release``: what every release of ``arch`` needs.
    """
    need = [(ARCHES[arch].qemu, "qemu-user"), ("debootstrap", "debootstrap"),
            ("dpkg-deb", "dpkg")]
    if any(a == arch and release in (None, r) for r, a in GUEST_FIXES):
        # The compiler, and the C library it links against.
        need += [(_cross_compiler(ARCHES[arch]), "gcc-" + ARCHES[arch].multiarch),
                 (_cross_compiler(ARCHES[arch]), f"libc6-dev-{arch}-cross")]
    if os.getuid() != 0:
        need.append(("fakeroot", "fakeroot"))  # debootstrap makes device nodes
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
    return [pkg for tool, pkg in need if shutil.which(tool, path=path) is None]


def debian_mirror() -> str:
    """The Debian mirror apt uses here (``$TETHER_DEBIAN_MIRROR`` overrides it)."""
    if os.environ.get(DEBIAN_MIRROR_ENV):
        return os.environ[DEBIAN_MIRROR_ENV]
    texts = []
    for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list")),
                 *sorted(glob.glob("/etc/apt/sources.list.d/*.sources"))]:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
        except OSError:
            pass
    for text in texts:
        for line in text.splitlines():
            line = line.split("#", 1)[0]
            for url in re.findall(r"(?:https?|file)://\S+", line):
                if re.search(r"/debian/?$", url):
                    return url.rstrip("/")
    return DEFAULT_MIRROR


def _run(argv: Sequence[str], what: str, cwd: Optional[str] = None,
         env: Optional[Dict[str, str]] = None, every: Optional[Callable[[], None]] = None):
    """Run a command to its end; ``every()`` is called every few seconds meanwhile."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(list(argv), cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, universal_newlines=True)
        try:
            while True:
                try:
                    proc.wait(PROGRESS_EVERY_S)
                    break
                except subprocess.TimeoutExpired:
                    if every is not None:
                        every()
        except BaseException:  # Ctrl-C or a stop: the command ends too
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        text = out.read()
    if proc.returncode != 0:
        tail = "\n".join(text.splitlines()[-15:])
        raise _CommandFailed(f"{what} failed (exit {proc.returncode}):\n{tail}", text)
    return text


PROGRESS_EVERY_S = 3.0


def _report_download(work: str, say) -> None:
    """How far debootstrap's download has come: packages and bytes in its cache."""
    debs = glob.glob(os.path.join(work, "var", "cache", "apt", "archives", "*.deb"))
    if debs:
        total = sum(os.path.getsize(d) for d in debs if os.path.exists(d))
        say(f"  downloaded {len(debs)} packages, {total / (1 << 20):.1f} MiB")


def _link_blas(root: str, arch: Arch):
    """The links to BLAS/LAPACK that the skipped postinst scripts (update-alternatives) make."""
    libdir = os.path.join(root, "usr", "lib", arch.multiarch)
    for name in ("libblas.so.3", "liblapack.so.3"):
        link = os.path.join(libdir, name)
        if os.path.lexists(link):
            continue
        family = name[3:-5]  # blas, lapack
        candidates = sorted(glob.glob(os.path.join(libdir, family + "*", name)),
                            key=lambda p: (os.path.basename(os.path.dirname(p)) != family, p))
        if not candidates:
            raise EmulationError(f"no {name} in {libdir}; numpy cannot load without it")
        os.symlink(os.path.relpath(candidates[0], libdir), link)


def guest_python(root: str) -> str:
    """The guest path of the release's python3.X binary."""
    found = sorted(glob.glob(os.path.join(root, "usr", "bin", "python3.[0-9]*")),
                   key=lambda p: [int(n) for n in re.findall(r"\d+", os.path.basename(p))])
    found = [p for p in found if re.fullmatch(r"python3\.\d+", os.path.basename(p))]
    if not found:
        raise EmulationError(f"no python3.X in {root}/usr/bin; delete {root} and build again")
    return "/usr/bin/" + os.path.basename(found[-1])


def build_rootfs(release: str, arch: str, progress: Progress = None,
                 mirror: Optional[str] = None, attempts: int = MIRROR_ATTEMPTS,
                 retry_delay_s: float = MIRROR_RETRY_DELAY_S) -> str:
    """Build (once) and return the root filesystem for ``release``/``arch``.

    A download the mirror spoils is tried ``attempts`` times in all, waiting
    ``retry_delay_s`` times the attempt number in between; then MirrorError.

    >>> build_rootfs("bookworm", "arm64")          # doctest: +SKIP
    '/home/me/.cache/tether/rootfs/bookworm-arm64'
    """
    spec = _check(release, arch)
    root = rootfs_path(release, arch)
    marker = os.path.join(root, ".tether-rootfs.json")
    if _current(marker) and _fixes_current(root, release, arch):
        return root
    missing = missing_tools(arch, release)
    if missing:
        raise EmulationError(f"emulated {release} {arch} boards need: "
                             f"apt-get install {' '.join(missing)}")
    os.makedirs(os.path.dirname(root), exist_ok=True)
    # Two processes building the same root filesystem wait for each other.
    with open(root + ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress is not None:
                progress(f"waiting for another process that is building {root} "
                         f"(it holds {root}.lock)")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not _current(marker):
            _build_with_retries(root, release, spec, progress, mirror or debian_mirror(),
                                attempts, retry_delay_s)
        if not _fixes_current(root, release, arch):
            _install_fixes(root, release, spec, progress)
    return root


def _current(marker: str) -> bool:
    try:
        with open(marker) as f:
            return json.load(f).get("format") == ROOTFS_FORMAT
    except (OSError, ValueError):
        return False


def _cross_compiler(arch: Arch) -> str:
    return arch.multiarch + "-gcc"


def _fix_source(name: str) -> bytes:
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), name), "rb") as f:
        return f.read()


def _preload_lines(root: str) -> List[str]:
    try:
        with open(os.path.join(root, "etc", "ld.so.preload")) as f:
            return f.read().split()
    except OSError:
        return []


def _fixes_current(root: str, release: str, arch: str) -> bool:
    """Whether the root filesystem holds exactly the fixes GUEST_FIXES asks for, built
    from the current sources."""
    fix = GUEST_FIXES.get((release, arch))
    ours = [line for line in _preload_lines(root) if line.startswith(FIX_DIR + "/")]
    if fix is None:
        return not ours
    source, _why = fix
    lib = f"{FIX_DIR}/{source[:-2]}.so"
    try:
        with open(root + f"{FIX_DIR}/{source}", "rb") as f:
            built_from = f.read()
    except OSError:
        return False
    return ours == [lib] and built_from == _fix_source(source) and os.path.isfile(root + lib)


def _install_fixes(root: str, release: str, arch: Arch, progress: Progress):
    """Build the preload library GUEST_FIXES names for this system with the host's cross
    compiler, put it in the root filesystem and list it in its /etc/ld.so.preload (or
    remove a fix that is no longer needed)."""
    say = progress or (lambda _msg: None)
    others = [line for line in _preload_lines(root) if not line.startswith(FIX_DIR + "/")]
    libs = []
    fix = GUEST_FIXES.get((release, arch.debian))
    if fix is not None:
        source, why = fix
        compiler = shutil.which(_cross_compiler(arch))
        if compiler is None:
            raise EmulationError(
                f"emulated {release} {arch.debian} boards need a workaround built with "
                f"{_cross_compiler(arch)}: apt-get install gcc-{arch.multiarch} "
                f"libc6-dev-{arch.debian}-cross")
        say(f"building {source[:-2]}.so into the root filesystem: Debian {release} "
            f"{arch.debian} {why} (see docs/boards.md)")
        fix_dir = root + FIX_DIR
        os.makedirs(fix_dir, exist_ok=True)
        lib = f"{FIX_DIR}/{source[:-2]}.so"
        tmp = root + lib + f".{os.getpid()}"
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), source)
        _run([compiler, "-shared", "-fPIC", "-O2", "-o", tmp, src, "-ldl"],
             f"{_cross_compiler(arch)} of {source} (needs gcc-{arch.multiarch} and "
             f"libc6-dev-{arch.debian}-cross)")
        os.replace(tmp, root + lib)
        with open(os.path.join(fix_dir, source), "wb") as f:
            f.write(_fix_source(source))
        libs.append(lib)
    preload = os.path.join(root, "etc", "ld.so.preload")
    if others or libs:
        with open(preload + ".tmp", "w") as f:
            f.write("".join(line + "\n" for line in others + libs))
        os.replace(preload + ".tmp", preload)
    elif os.path.exists(preload):
        os.unlink(preload)


def _build_with_retries(root: str, release: str, arch: Arch, progress: Progress, mirror: str,
                        attempts: int, retry_delay_s: float):
    """Build in a fresh hidden folder next to ``root`` and move it there once complete."""
    say = progress or (lambda _msg: None)
    for attempt in range(1, attempts + 1):
        try:
            _build_suites(root, release, arch, progress, mirror)
            return
        except _CommandFailed as exc:
            spoiled = _mirror_failures(exc.output)
            if not spoiled:
                raise
            if attempt == attempts:
                said = "\n".join(dict.fromkeys(spoiled))
                raise MirrorError(
                    f"could not download Debian {release} {arch.debian} from the mirror {mirror} "
                    f"({attempts} attempts): it served a broken index or did not answer. "
                    f"debootstrap said:\n{said}\nTry again later, or choose another Debian "
                    f"mirror: {DEBIAN_MIRROR_ENV}=http://MIRROR/debian") from None
            wait_s = retry_delay_s * attempt
            worst = next(line for sign in MIRROR_FAILURES for line in spoiled if sign in line)
            say(f"the mirror {mirror} failed ({worst}); trying again in {wait_s:g} s "
                f"({attempt + 1} of {attempts})")
            time.sleep(wait_s)


def _mirror_failures(output: str) -> List[str]:
    return [line.strip() for line in output.splitlines()
            if any(sign in line for sign in MIRROR_FAILURES)]


def _build_suites(root: str, release: str, arch: Arch, progress: Progress, mirror: str):
    """Build ``release`` from the mirror, or from a suite alias of it on the mirror.

    A mirror can hold a release's index files out of step with the Release file
    that lists their checksums (seen for trixie armhf: "Packages.gz was corrupt"
    on every try) while its alias ("stable" for trixie) is consistent, signed
    by Debian as well. Aliases are tried only after the release's own name
    failed that way.
    """
    say = progress or (lambda _msg: None)
    try:
        _build_suite(root, release, release, arch, progress, mirror)
        return
    except _CommandFailed as exc:
        if not any("was corrupt" in line for line in _mirror_failures(exc.output)):
            raise
        aliases = _suite_aliases(mirror, release)
        if not aliases:
            raise
        first_failure = exc
    for alias in aliases:
        say(f"the mirror's {release} index does not match its Release file; trying its "
            f"{alias!r} suite (codename {release})")
        try:
            _build_suite(root, alias, release, arch, progress, mirror)
            return
        except _CommandFailed:
            continue
    raise first_failure


def _suite_aliases(mirror: str, release: str) -> List[str]:
    """The mirror's suite names (stable, oldstable, ...) whose codename is ``release``."""
    import urllib.request
    found = []
    for alias in SUITE_ALIASES:
        try:
            with urllib.request.urlopen(f"{mirror}/dists/{alias}/Release", timeout=30) as reply:
                head = reply.read(4096).decode("utf-8", "replace")
        except (OSError, ValueError):
            continue
        if re.search(rf"^Codename:\s*{re.escape(release)}\s*$", head, re.MULTILINE):
            found.append(alias)
    return found


def _build_suite(root: str, suite: str, release: str, arch: Arch, progress: Progress, mirror: str):
    work = tempfile.mkdtemp(prefix=f".{release}-{arch.debian}-", dir=os.path.dirname(root))
    os.chmod(work, 0o755)
    try:
        _build_into(work, suite, release, arch, progress, mirror)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    if os.path.isdir(root):
        shutil.rmtree(root)
    os.rename(work, root)


def _wget_settings(path: str) -> str:
    """A wgetrc with the user's own settings (proxies, certificates) plus WGET_SETTINGS."""
    own = os.environ.get("WGETRC") or os.path.join(os.path.expanduser("~"), ".wgetrc")
    try:
        with open(own, encoding="utf-8", errors="replace") as f:
            text = f.read().rstrip("\n") + "\n"
    except OSError:
        text = ""
    with open(path, "w") as f:
        f.write(text + WGET_SETTINGS)  # later lines win
    return path


def _build_into(work: str, suite: str, release: str, arch: Arch, progress: Progress, mirror: str):
    say = progress or (lambda _msg: None)
    named = release if suite == release else f"{release} ({suite})"
    say(f"downloading Debian {named} {arch.debian} packages from {mirror}")
    argv = ["debootstrap", "--foreign", f"--arch={arch.debian}", "--variant=minbase",
            f"--include={','.join(PACKAGES + EXTRA_PACKAGES.get(release, ()))}", suite, work, mirror]
    if os.getuid() != 0:
        argv.insert(0, "fakeroot")
    env_path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    argv[argv.index("debootstrap")] = shutil.which("debootstrap", path=env_path) or "debootstrap"
    wgetrc = _wget_settings(work + ".wgetrc")
    try:
        _run(argv, f"debootstrap of {release} {arch.debian}", env={**os.environ, "WGETRC": wgetrc},
             every=lambda: _report_download(work, say))
    finally:
        os.unlink(wgetrc)
    # The second stage would run maintainer scripts under emulation (minutes);
    # unpacking is all a Python runtime needs.
    debs = sorted(glob.glob(os.path.join(work, "var", "cache", "apt", "archives", "*.deb")))
    for done, deb in enumerate(debs, 1):
        say(f"unpacking packages {done}/{len(debs)}")
        _run(["dpkg-deb", "-x", deb, work], f"dpkg-deb -x {os.path.basename(deb)}")
        os.unlink(deb)
    _link_blas(work, arch)
    python = guest_python(work)
    with open(os.path.join(work, ".tether-rootfs.json"), "w") as f:
        json.dump({"format": ROOTFS_FORMAT, "release": release, "suite": suite, "arch": arch.debian,
                   "python": python, "mirror": mirror, "built": time.time()}, f)
    say(f"root filesystem ready ({python})")


def _write_launcher(root: str, arch: Arch, python: str) -> str:
    """A host shell script that starts the guest python under qemu.

    The server runs with this script as ``sys.executable``: when it starts a
    child Python (``subprocess``/``multiprocessing``), the guest execve reaches
    the host kernel as a shell script, which runs qemu again. Without it a child
    would need binfmt_misc registrations for ARM binaries on the host.

    Every path the guest Python uses is given as the host's absolute path into
    the root filesystem: qemu's ``-L`` prefix is not applied by every system
    call (qemu 7.2 skips it for statx, which trixie's glibc uses), so a guest
    path such as /usr/lib/python3.13 would be looked up on the host.
    """
    launcher = root + ".python"
    qemu = shutil.which(arch.qemu) or arch.qemu
    q = shlex.quote
    text = ("#!/bin/sh\n"
            f"PYTHONHOME={q(root + '/usr')} TMPDIR={q(root + '/tmp')} HOME={q(root + '/root')}\n"
            "export PYTHONHOME TMPDIR HOME\n"
            f"exec {q(qemu)} -cpu {arch.cpu} -L {q(root)} -0 {q(launcher)} {q(root + python)} \"$@\"\n")
    tmp = launcher + f".{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o755)
    os.replace(tmp, launcher)
    return launcher


class EmulatedBoard:
    """One device server running under qemu in a cached Debian root filesystem."""

    def __init__(self, release: str = "bookworm", arch: str = "arm64", progress: Progress = None):
        self.spec = _check(release, arch)
        self.release, self.arch = release, arch
        self.registration = ""  # the server's own words: registered with ..., or still trying
        self.progress = progress
        self.proc: Optional[subprocess.Popen] = None
        self.port: Optional[int] = None
        self.root: Optional[str] = None
        self.log_path: Optional[str] = None
        self._log = None
        self._log_dir: Optional[str] = None  # made by start(), removed by stop()

    def prepare(self) -> List[str]:
        """Build the root filesystem if needed, refresh the device code; the python argv."""
        self.root = build_rootfs(self.release, self.arch, self.progress)
        with open(os.path.join(self.root, ".tether-rootfs.json")) as f:
            python = json.load(f)["python"]
        copy_device_files(self.code_dir)
        return [_write_launcher(self.root, self.spec, python)]

    @property
    def code_dir(self) -> str:
        """The device-side files, inside the root filesystem (as a host path)."""
        return rootfs_path(self.release, self.arch) + CODE_DIR

    def command(self, args: Sequence[str]) -> List[str]:
        return self.prepare() + list(args)

    def environment(self) -> Dict[str, str]:
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
               "PYTHONPATH": self.code_dir, "PYTHONUNBUFFERED": "1",
               EMULATED_ENV: f"{ARCHES[self.arch].qemu} -cpu {ARCHES[self.arch].cpu}, "
                             f"Debian {self.release} {self.arch}"}
        if FARM_SECRET_ENV in os.environ:
            env[FARM_SECRET_ENV] = os.environ[FARM_SECRET_ENV]
        return env

    def start(self, tracker: Optional[str] = None, key: Optional[str] = None,
              host: str = "127.0.0.1", port: int = 0, extra: Sequence[str] = (),
              log_path: Optional[str] = None, timeout: float = STARTUP_TIMEOUT_S,
              end_with_caller: bool = False) -> int:
        """Start the server; returns its port once it listens.

        ``end_with_caller``: the kernel ends the server when the calling thread
        ends, even by SIGKILL (``tether emulate`` asks for it).

        Without ``log_path`` the log goes to a temporary folder that ``stop()``
        removes, unless the server failed: then the error names the log, kept.
        """
        args = ["-m", "remote.server", "--host", host, "--port", str(port)]
        if tracker:
            args += ["--tracker", tracker, "--key", key or f"qemu-{self.arch}"]
        argv = self.command(args + list(extra))
        if log_path is None:
            self._log_dir = tempfile.mkdtemp(prefix="tether-emulate-")
            log_path = os.path.join(self._log_dir, "server.log")
        self.log_path = log_path
        try:
            self._log = open(self.log_path, "wb")
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._log,
                                         env=self.environment(), cwd=self.code_dir,
                                         start_new_session=True,
                                         preexec_fn=ends_with_parent(os.getpid())
                                         if end_with_caller else None)
            if self.progress is not None:
                self.progress(f"starting the device server under {ARCHES[self.arch].qemu} "
                              f"-cpu {ARCHES[self.arch].cpu}")
            self.port = self._read_port(timeout)
        except BaseException as exc:
            self.stop(keep_log=isinstance(exc, EmulationError))
            raise
        return self.port

    def _read_port(self, timeout: float) -> int:
        """The port of the server's "listening on HOST:PORT" line; fails as soon as it exits."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EmulationError(
                    f"the emulated {self.release} {self.arch} server is running but did not "
                    f"start listening within {timeout:g} s (is the machine overloaded?); its "
                    f"log {self.log_path} ends:\n{self.log_tail()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 0.5))
            if ready:
                line = self.proc.stdout.readline()
                if b"listening on" in line:
                    # What the server says of its tracker: registered, or still trying.
                    text = line.decode("utf-8", "replace").strip()
                    self.registration = text[text.find("(") + 1:text.rfind(")")] \
                        if "(" in text else ""
                    return int(line.split(b"listening on", 1)[1].split()[0].rsplit(b":", 1)[1])
                if not line:  # end of output: the server is exiting
                    break
            elif self.proc.poll() is not None:
                break
        try:
            ended = f"exited with code {self.proc.wait(10)}"
        except subprocess.TimeoutExpired:
            ended = "closed its output"
        raise EmulationError(
            f"the emulated {self.release} {self.arch} server {ended} before it was "
            f"listening; its log {self.log_path} ends:\n{self.log_tail()}\n{self._advice()}")

    def _advice(self) -> str:
        tail = self.log_tail()
        if "ImportError" in tail or "ModuleNotFoundError" in tail:
            return (f"A module failed to import on the board. Files under {self.code_dir} are "
                    f"tether's device-side files, copied from {PROJECT_ROOT}; the rest is "
                    f"Debian {self.release}'s in {self.root}. If the failing file is under "
                    f"{self.code_dir}, this tether install is broken: reinstall or upgrade "
                    f"tether. Otherwise delete {self.root} so that it is built again.")
        return "Fix what the log names, then start the board again."

    def log_tail(self, lines: int = 20) -> str:
        if not self.log_path:
            return ""
        if self._log:
            self._log.flush()
        with open(self.log_path, "rb") as f:
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")

    def wait(self) -> int:
        return self.proc.wait()

    def stop(self, keep_log: bool = False):
        """Stop the server and whatever it started; remove the log folder ``start()`` made
        unless ``keep_log``."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()  # the server stops its module workers itself
                try:
                    self.proc.wait(20)
                except subprocess.TimeoutExpired:
                    # Its workers (each a qemu of its own) share its process group, whose
                    # id stays reserved until the server is reaped: kill them all with it.
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait()
            if self.proc.stdout:
                self.proc.stdout.close()
        if self._log:
            self._log.close()
            self._log = None
        if self._log_dir and not keep_log:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            self._log_dir = None

    def __enter__(self) -> "EmulatedBoard":
        return self

    def __exit__(self, *exc):
        self.stop()


def ends_with_parent(parent: int):
    """A ``preexec_fn`` that has the kernel kill the child when the thread that
    started it ends, however it ends (SIGKILL included): an emulated board must
    not stay registered after its ``tether emulate`` is gone. Linux only; the
    setting survives the launcher's exec of qemu."""
    def arrange():
        import ctypes
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # it ended before the setting took
            os._exit(1)
    return arrange


def run_emulated_board(args) -> int:
    """``tether emulate``: build if needed, then serve until Ctrl-C (or SIGTERM, which
    the command line turns into KeyboardInterrupt too)."""
    from remote.cli.progress import Steps
    steps = Steps()  # a ticking line per step on a terminal, plain lines when piped

    def say(msg):
        steps(f"[{args.release}-{args.arch}] {msg}")

    if args.build_only:
        root = build_rootfs(args.release, args.arch, say)
        steps.close()
        print(root)
        return 0
    board = EmulatedBoard(args.release, args.arch, progress=say)
    key = args.key or f"qemu-{args.arch}"
    try:
        port = board.start(args.tracker or default_tracker(), key, host=args.host, port=args.port,
                           end_with_caller=True)
    finally:
        steps.close()
    exited = False
    try:
        print(f"emulated {args.release} {args.arch} board listening on {args.host}:{port} "
              f"({board.registration or 'standalone'}; log {board.log_path})", flush=True)
        code = board.wait()
        exited = True
    except KeyboardInterrupt:
        return 0
    finally:
        # A second Ctrl-C must not cut the cleanup short and leave qemu running.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        board.stop(keep_log=exited)
    raise EmulationError(f"the emulated server exited with {code}; its log {board.log_path} "
                         f"ends:\n{board.log_tail()}")
