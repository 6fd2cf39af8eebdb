"""Only what pyproject.toml cannot say: the notebooks/ folder ships inside the package as
ttx_tutorial.notebooks (``python -m ttx_tutorial notebooks DEST`` copies it out), next to every
package under ttx_tutorial/. Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["ttx_tutorial", "ttx_tutorial.*"]), "ttx_tutorial.notebooks"],
    package_dir={"ttx_tutorial.notebooks": "notebooks"},
)
