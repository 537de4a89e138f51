"""Packaging: each top-level folder is one precast package (docs/architecture.md, "Layout"); their subpackages
are found, not listed. Everything else about the project is in pyproject.toml."""

from setuptools import find_packages, setup

FOLDERS = {
    "precast": "precast",
    "precast.artifact": "artifact",
    "precast.runtime": "runtime",
    "precast.ir": "ir",
    "precast.passes": "passes",
    "precast.targets": "targets",
    "precast.compiler": "compiler",
    "precast.cli": "cli",
}

setup(
    packages=[pkg for name, folder in FOLDERS.items() for pkg in [name, *(f"{name}.{p}" for p in find_packages(folder))]],
    package_dir=FOLDERS,
)
