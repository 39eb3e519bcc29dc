"""The package list, found rather than written out: ``cli/`` and ``converters/`` install as ``ckpt.cli`` and
``ckpt.converters`` (``package-dir`` in pyproject.toml), a prefix mapping that ``[tool.setuptools.packages.find]``
cannot express.  Everything else about the project is in pyproject.toml.

Namespace discovery, so that a folder without ``__init__.py`` (``ckpt/resume``) and every package below it are
installed too; a new package needs no edit here.
"""

from setuptools import find_namespace_packages, setup


def _packages(folder: str, name: str) -> list[str]:
    found = find_namespace_packages(folder, exclude=["*__pycache__*"])
    return [name] + [f"{name}.{p}" for p in found]


setup(
    packages=_packages("ckpt", "ckpt")
    + _packages("cli", "ckpt.cli")
    + _packages("converters", "ckpt.converters")
)
