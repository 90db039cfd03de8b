"""What a board receives: the exact list of device-side files, and the import rule
they keep (DESIGN.md, contract 1).

Device-side code imports only the standard library every board Python has (3.9
to 3.13), numpy, google.protobuf and the project's own device-side
modules; never the host-only parts (remote.client, remote.cli, remote.tracker,
remote.rpc, crosscompile, deploy_recipes), which a board does not receive.
"""
import os
import pkgutil
import sys
import sysconfig

from deploy_recipes.devicecode import PROJECT_PACKAGES, device_files, file_imports, module_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Everything `tether bootstrap` and `tether emulate` put on a board. A change here
# changes what every board runs: review it as such.
SHIPPED = [
    "minirt/__init__.py",
    "minirt/elf.py",
    "minirt/errors.py",
    "minirt/module.py",
    "minirt/timing.py",
    "remote/__init__.py",
    "remote/address.py",
    "remote/defaults.py",
    "remote/errors.py",
    "remote/lifecycle.py",
    "remote/proto/__init__.py",
    "remote/proto/descriptor.py",
    "remote/proto/frames.py",
    "remote/proto/http2.py",
    "remote/proto/tensors.py",
    "remote/proto/tether_v1.proto",
    "remote/server/__init__.py",
    "remote/server/__main__.py",
    "remote/server/daemon.py",
    "remote/server/devinfo.py",
    "remote/server/isolation.py",
    "remote/server/registration.py",
    "remote/server/service.py",
    "remote/server/worker.py",
    "remote/server/workspace.py",
    "remote/tls.py",
]
DEPENDENCIES = ("numpy", "google.protobuf")
HOST_ONLY = ("remote.client", "remote.cli", "remote.tracker", "remote.rpc",
             "crosscompile", "deploy_recipes")
# Standard-library modules that some board Python lacks: added after 3.9, or
# removed by 3.13 (Debian trixie).
NOT_ON_EVERY_BOARD = {
    "tomllib", "distutils", "imp", "asynchat", "asyncore", "smtpd", "cgi", "cgitb", "crypt",
    "pipes", "telnetlib", "nntplib", "audioop", "chunk", "imghdr", "mailcap", "nis",
    "ossaudiodev", "sndhdr", "spwd", "sunau", "uu", "xdrlib", "lib2to3",
}


def standard_library():
    names = set(sys.builtin_module_names) | set(getattr(sys, "stdlib_module_names", ()))
    if not hasattr(sys, "stdlib_module_names"):  # Python 3.9: list the stdlib folders
        stdlib = sysconfig.get_paths()["stdlib"]
        names.update(m.name for m in pkgutil.iter_modules(
            [stdlib, os.path.join(stdlib, "lib-dynload")]))
    return names


def _within(name, prefixes):
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def rule_violations(root, files):
    """``file:line: imports NAME (why)`` for every import of ``files`` that breaks the rule."""
    stdlib = standard_library()
    found = []
    for rel in files:
        if not rel.endswith(".py"):
            continue
        for line, name in file_imports(os.path.join(root, *rel.split("/")), module_name(rel)):
            top = name.split(".")[0]
            if top in PROJECT_PACKAGES:
                why = "host-only" if _within(name, HOST_ONLY) else None
            elif top in NOT_ON_EVERY_BOARD:
                why = "not in every board's Python 3.9-3.13"
            elif top in stdlib or _within(name, DEPENDENCIES) or \
                    any(dep.startswith(name + ".") for dep in DEPENDENCIES):
                why = None  # "from google import protobuf" names the google namespace first
            else:
                why = "not the standard library, numpy or protobuf"
            if why:
                found.append(f"{rel}:{line}: imports {name} ({why})")
    return found


def test_the_files_shipped_to_a_board_are_exactly_the_device_side_ones():
    assert device_files(ROOT) == SHIPPED


def test_every_shipped_file_imports_only_what_a_board_has():
    problems = rule_violations(ROOT, device_files(ROOT))
    assert not problems, "device-side imports a board cannot satisfy:\n" + "\n".join(problems)


def test_the_rule_names_file_line_and_import_of_each_break(tmp_path):
    """A device-side file that reaches for host code is reported line by line, and the
    host code it names would be shipped, so the pinned list changes too."""
    for rel, text in {
        "minirt/__init__.py": "from . import kernels\n",
        "minirt/kernels.py": ("import os\n"
                              "import numpy as np\n"
                              "from google import protobuf\n"
                              "import onnx\n"
                              "from remote import rpc\n"
                              "from crosscompile import build\n"
                              "import tomllib\n"
                              "import grpc\n"),
        "remote/__init__.py": "",
        "remote/rpc.py": "",
        "crosscompile/__init__.py": "build = None\n",
    }.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in ("remote/server", "remote/proto"):
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
    files = device_files(str(tmp_path))
    assert files == ["crosscompile/__init__.py", "minirt/__init__.py", "minirt/kernels.py",
                     "remote/__init__.py", "remote/rpc.py"]
    assert rule_violations(str(tmp_path), files) == [
        "minirt/kernels.py:4: imports onnx (not the standard library, numpy or protobuf)",
        "minirt/kernels.py:5: imports remote.rpc (host-only)",
        "minirt/kernels.py:6: imports crosscompile (host-only)",
        "minirt/kernels.py:6: imports crosscompile.build (host-only)",
        "minirt/kernels.py:7: imports tomllib (not in every board's Python 3.9-3.13)",
        # Boards speak frames (protocol v2): grpcio is no longer theirs.
        "minirt/kernels.py:8: imports grpc (not the standard library, numpy or protobuf)",
    ]
