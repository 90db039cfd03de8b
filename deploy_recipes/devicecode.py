"""Which of the project's files a board needs: the device-side packages and what they import.

Every module of the device-side packages (DESIGN.md, contract 1) is an entry,
since some run as their own processes (``python -m remote.server.worker``) and
no import statement names them; the list then follows the import statements,
so a new device-side helper is shipped to boards without anyone editing a list.

    >>> files = device_files()
    >>> "remote/server/__main__.py" in files and "crosscompile/__init__.py" not in files
    True
"""
from __future__ import annotations

import ast
import os
import shutil
from typing import Iterable, List, Optional, Set

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE_PACKAGES = ("remote.server", "remote.proto", "minirt")


def _package_modules(root: str, packages: Iterable[str]) -> List[str]:
    modules = []
    for package in packages:
        folder = os.path.join(root, *package.split("."))
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                stem = name[:-3]
                modules.append(package if stem == "__init__" else f"{package}.{stem}")
    return modules
# Non-Python files the device side reads at run time.
DATA_FILES = ("remote/proto/tether_v1.proto",)


def _module_file(root: str, module: str) -> Optional[str]:
    base = os.path.join(root, *module.split("."))
    for candidate in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


def _imports(path: str, module: str, is_package: bool) -> Iterable[str]:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            yield target
            for alias in node.names:  # "from remote import errors" names a module
                yield f"{target}.{alias.name}"
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "__import__" \
                and node.args and isinstance(node.args[0], ast.Constant):
            yield str(node.args[0].value)


def device_files(root: str = PROJECT_ROOT) -> List[str]:
    """Paths (relative to ``root``, "/"-separated) of every project file a board needs."""
    seen: Set[str] = set()
    files: Set[str] = set()
    todo = _package_modules(root, DEVICE_PACKAGES)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = _module_file(root, module)
        if path is None:
            continue  # the standard library, numpy, grpc, protobuf
        files.add(path)
        # Importing a.b.c runs a/__init__.py and a/b/__init__.py first.
        parts = module.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        todo.extend(_imports(path, module, path.endswith("__init__.py")))
    rel = {os.path.relpath(p, root).replace(os.sep, "/") for p in files}
    rel.update(d for d in DATA_FILES if os.path.isfile(os.path.join(root, d)))
    return sorted(rel)


def copy_device_files(dest: str, root: str = PROJECT_ROOT) -> List[str]:
    """Copy the device-side files into ``dest`` (replacing what was there); returns them."""
    files = device_files(root)
    if os.path.isdir(dest):
        shutil.rmtree(dest)
    for rel in files:
        target = os.path.join(dest, *rel.split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(os.path.join(root, *rel.split("/")), target)
    return files
