"""The package list, found rather than kept by hand; the rest of the build is in pyproject.toml.

Every folder under ``xlatorch/`` with an ``__init__.py`` is a package, found at build time, so
a new subpackage ships without anyone listing it. ``xlatorch._generated`` lives in the
top-level ``generated/`` (``[tool.setuptools.package-dir]``), and pyproject.toml's
``[tool.setuptools.packages.find]`` can only name a package after its folder, so it is added
here. The ``xlatorch.compat`` front stubs are top-level packages of their own in the runner's
processes, never ``xlatorch.compat.front.*``: they ship as package data.
"""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["xlatorch", "xlatorch.*"], exclude=["xlatorch.compat.front*"]),
        "xlatorch._generated",
    ]
)
