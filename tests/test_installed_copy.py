"""A plain (non-editable) `pip install` of tether ships the same device files as the
source tree, and its `tether emulate` brings up a board that serves sessions.

As after a user's `pip install .`, the test venv's site-packages holds tether
next to numpy, grpc, google.protobuf and setuptools: links to the packages of
the Python running the tests (so nothing is downloaded), leaving out that
Python's own tether, whose editable hook would lead back to this tree.
"""
import json
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from deploy_recipes.devicecode import PROJECT_PACKAGES, device_files
from deploy_recipes.emulate import EmulatedBoard
from remote import rpc
from tests.cli_processes import (ROOT, ended, interrupt, skip_without_emulation_tools,
                                 start_emulate)
from tests.emulated_boards import local_farm


def _env_outside_the_tree():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _part_of_tether(folder, name):
    if name in PROJECT_PACKAGES or name.startswith(("__editable__", "tether-", "tether.")):
        return True
    if name.endswith(".pth"):
        with open(os.path.join(folder, name), errors="replace") as f:
            return ROOT in f.read()
    return False


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python, tether, a folder outside the tree) of a venv where tether is installed from
    a copy of this tree."""
    base = tmp_path_factory.mktemp("installed")
    # A copy, so that the build's own folders (build/, *.egg-info) stay out of the tree.
    source = base / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), source / name)
    for package in PROJECT_PACKAGES:
        shutil.copytree(os.path.join(ROOT, package), source / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          stdout=subprocess.PIPE, universal_newlines=True, check=True).stdout.strip()
    for folder in dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]):
        for name in os.listdir(folder):
            if not _part_of_tether(folder, name) and not os.path.lexists(os.path.join(site, name)):
                os.symlink(os.path.join(folder, name), os.path.join(site, name))
    install = subprocess.run(
        [python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", str(source)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True,
        env=_env_outside_the_tree(), cwd=str(base))
    assert install.returncode == 0, install.stdout
    # As after `pip install .` in a checkout: the build cleaned up after itself.
    assert sorted(os.listdir(source)) == sorted(["pyproject.toml", "README.md", *PROJECT_PACKAGES])
    return python, str(venv / "bin" / "tether"), str(base)


def test_installed_copy_has_the_systemd_units_the_readme_points_to(installed):
    python, _, outside = installed
    probe = subprocess.run(
        [python, "-c", "import deploy_recipes, os; print(os.path.dirname(deploy_recipes.__file__))"],
        stdout=subprocess.PIPE, universal_newlines=True, env=_env_outside_the_tree(), cwd=outside,
        check=True)
    units = os.path.join(probe.stdout.strip(), "systemd")
    assert sorted(os.listdir(units)) == sorted(os.listdir(os.path.join(ROOT, "deploy_recipes",
                                                                       "systemd")))


def test_installed_copy_ships_the_same_device_files_as_the_tree(installed):
    python, _, outside = installed
    probe = subprocess.run(
        [python, "-c", "import json; from deploy_recipes import devicecode; "
                       "print(json.dumps([devicecode.PROJECT_ROOT, devicecode.device_files()]))"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
        env=_env_outside_the_tree(), cwd=outside)
    assert probe.returncode == 0, probe.stderr
    project_root, files = json.loads(probe.stdout)
    assert project_root.startswith(os.path.dirname(os.path.dirname(python))), \
        f"the test venv imported tether from {project_root}, not from its own install"
    assert files == device_files(ROOT)


@pytest.mark.emulated
@pytest.mark.bookworm_arm64
def test_tether_emulate_from_an_installed_copy_serves_a_session(installed):
    skip_without_emulation_tools("arm64", "bookworm")
    _, tether, outside = installed
    with local_farm() as farm:
        proc, _ = start_emulate([tether], farm, "emu-installed", _env_outside_the_tree(),
                                cwd=outside)
        with ended(proc):
            with rpc.connect_tracker(*farm.tracker).request("emu-installed", timeout=60) as sess:
                info = sess.device_info()
            assert info["machine"] == "aarch64"
            assert "Debian" in info["os"]
            # The board runs Debian's own numpy/grpcio/protobuf: no host copy shadows them.
            code_dir = EmulatedBoard("bookworm", "arm64").code_dir
            on_board = sorted(
                os.path.relpath(os.path.join(folder, name), code_dir).replace(os.sep, "/")
                for folder, dirs, names in os.walk(code_dir) if "__pycache__" not in folder
                for name in names)
            assert on_board == device_files(ROOT)
            code, err = interrupt(proc)
            assert code == 0, err
