"""Which of the project's files a board needs: the device-side packages and what they import.

Every module of the device-side packages (DESIGN.md, contract 1) is an entry,
since some run as their own processes (``python -m remote.server.worker``) and
no import statement names them; the list then follows the import statements,
so a new device-side helper is shipped to boards without anyone editing a list.
Only imports of the project's own packages are followed: the list is the same
whether the project is a source tree or an installed copy in site-packages next
to numpy and protobuf (a board brings its own numpy and protobuf; a host
copy of them would shadow those and fail to load there).

    >>> files = device_files()
    >>> "remote/server/__main__.py" in files and "crosscompile/__init__.py" not in files
    True
"""
from __future__ import annotations

import ast
import os
import shutil
from typing import Iterable, Iterator, List, NamedTuple, Optional, Set

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE_PACKAGES = ("remote.server", "remote.proto", "minirt")
# The project's top-level packages (pyproject.toml's packages.find); an import of
# anything else is the standard library's or a dependency's, never shipped.
PROJECT_PACKAGES = ("remote", "minirt", "crosscompile", "deploy_recipes")


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


class Import(NamedTuple):
    line: int
    name: str  # absolute dotted name; "from a import b" gives both "a" and "a.b"


def module_name(rel_path: str) -> str:
    """The module a project file (a "/"-separated path) is.

    >>> module_name("remote/server/__main__.py"), module_name("minirt/__init__.py")
    ('remote.server.__main__', 'minirt')
    """
    parts = rel_path[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


IMPORT_CALLS = ("__import__", "importlib.import_module", "import_module")


def file_imports(path: str, module: str) -> Iterator[Import]:
    """Every module ``path`` (the file of ``module``) imports, relative imports made absolute.

    Calls of ``__import__`` and ``importlib.import_module`` count when their name is
    a literal.

    >>> path = os.path.join(PROJECT_ROOT, "remote", "server", "workspace.py")
    >>> "remote.errors" in {found.name for found in file_imports(path, "remote.server.workspace")}
    True
    """
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    is_package = os.path.basename(path) == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            yield Import(node.lineno, target)
            for alias in node.names:  # "from remote import errors" names a module
                yield Import(node.lineno, f"{target}.{alias.name}")
        elif isinstance(node, ast.Call) and _call_name(node.func) in IMPORT_CALLS \
                and node.args and isinstance(node.args[0], ast.Constant):
            yield Import(node.lineno, str(node.args[0].value))


def _call_name(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return f"{func.value.id}.{func.attr}"
    return ""


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
        if module.split(".")[0] not in PROJECT_PACKAGES:
            continue  # the standard library, numpy, protobuf
        path = _module_file(root, module)
        if path is None:
            continue  # a name imported from a module, not a module itself
        files.add(path)
        # Importing a.b.c runs a/__init__.py and a/b/__init__.py first.
        parts = module.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        todo.extend(found.name for found in file_imports(path, module))
    rel = {os.path.relpath(p, root).replace(os.sep, "/") for p in files}
    rel.update(d for d in DATA_FILES if os.path.isfile(os.path.join(root, d)))
    return sorted(rel)


def copy_device_files(dest: str, root: str = PROJECT_ROOT) -> List[str]:
    """Copy the device-side files into ``dest`` (replacing what was there); returns them.

    A ``dest`` that already holds exactly these files is left alone: an emulated
    board may be running from it.
    """
    files = device_files(root)
    if _holds_exactly(dest, root, files):
        return files
    if os.path.isdir(dest):
        shutil.rmtree(dest)
    for rel in files:
        target = os.path.join(dest, *rel.split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(os.path.join(root, *rel.split("/")), target)
    return files


def _holds_exactly(dest: str, root: str, files: List[str]) -> bool:
    present = set()
    for folder, dirs, names in os.walk(dest):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        present.update(os.path.relpath(os.path.join(folder, n), dest).replace(os.sep, "/")
                       for n in names)
    if present != set(files):
        return False
    for rel in files:
        with open(os.path.join(root, *rel.split("/")), "rb") as want, \
                open(os.path.join(dest, *rel.split("/")), "rb") as have:
            if want.read() != have.read():
                return False
    return True
