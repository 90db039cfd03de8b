"""How to add an optional extra (matplotlib for plots, tqdm for bars), said for
the way this copy of Tether was installed: Tether is not on PyPI, so
``pip install 'tether[plot]'`` cannot work.

>>> install_command("plot", "matplotlib>=3.3")          # doctest: +SKIP
'bash /home/me/tether/deploy_recipes/venv.sh plot'
"""
from __future__ import annotations

import os
import shlex
import sys


def _checkout() -> "str | None":
    """The checkout this copy runs from (an editable install), or None."""
    top = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    marks = ("pyproject.toml", os.path.join("deploy_recipes", "venv.sh"))
    return top if all(os.path.isfile(os.path.join(top, m)) for m in marks) else None


def install_command(extra: str, packages: str) -> str:
    """The command that installs ``extra`` (``packages`` as pip names them) where
    this Tether runs: the checkout's own script when it runs from that checkout's
    .venv, else pip of the running interpreter."""
    checkout = _checkout()
    if checkout is not None and os.path.realpath(sys.prefix) == \
            os.path.realpath(os.path.join(checkout, ".venv")):
        return f"bash {shlex.quote(os.path.join(checkout, 'deploy_recipes', 'venv.sh'))} {extra}"
    return f"{shlex.quote(sys.executable)} -m pip install {shlex.quote(packages)}"
