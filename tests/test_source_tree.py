"""The project's own Python files: no module defines a top-level function
or class twice (the second silently replaces the first, and every caller
of the first then gets the second)."""
import ast
import glob
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("crosscompile", "minirt", "remote", "deploy_recipes", "benchmarks", "tests")


def redefinitions(source: str) -> list:
    """(name, first line, second line) of each top-level def or class defined again."""
    seen, twice = {}, []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name in seen:
                twice.append((node.name, seen[node.name], node.lineno))
            seen[node.name] = node.lineno
    return twice


def test_a_second_definition_of_a_name_is_found():
    assert redefinitions("def f():\n    pass\n\nclass C:\n    pass\n\ndef f(x):\n    pass\n") == [("f", 1, 7)]
    assert redefinitions("def f():\n    pass\n\ndef g():\n    pass\n") == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_defines_a_top_level_name_twice(package):
    files = sorted(glob.glob(os.path.join(ROOT, package, "**", "*.py"), recursive=True))
    assert files, f"no Python files under {package}"
    found = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            found += [f"{os.path.relpath(path, ROOT)}: {name} at lines {a} and {b}"
                      for name, a, b in redefinitions(f.read())]
    assert not found, "defined twice (the second replaces the first):\n" + "\n".join(found)
