"""The build backend of ``pip install .``: setuptools', leaving the checkout as it was.

setuptools builds in folders of the source tree (``build/``,
``tether.egg-info/``) and leaves them behind; a checkout should not gain
folders because someone installed from it. Each hook here runs setuptools'
own and then removes those folders if that hook made them.
"""
from __future__ import annotations

import functools
import glob
import inspect
import os
import shutil

from setuptools import build_meta as _setuptools

_LEFT_BY_BUILDS = ("build", "*.egg-info")


def _existing() -> set:
    return {p for pattern in _LEFT_BY_BUILDS for p in glob.glob(pattern)}


def _tidy(hook):
    @functools.wraps(hook)
    def tidy_hook(*args, **kwargs):
        before = _existing()
        try:
            return hook(*args, **kwargs)
        finally:
            for path in sorted(_existing() - before):
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.unlink(path)
    return tidy_hook


# Every hook, the questions before a build (get_requires_*) included: setuptools
# writes its egg-info for those too.
globals().update({name: _tidy(getattr(_setuptools, name)) for name in _setuptools.__all__
                  if inspect.isroutine(getattr(_setuptools, name))})
