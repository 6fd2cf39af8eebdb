"""The torch and triton versions this package claims to work with, checked where the suite runs.

``ttx_tutorial.COMPATIBILITY`` is the one place that declares the lowest and highest tested
versions: ``{"torch": (lowest, highest), "triton": (lowest, highest)}`` as "major.minor"
strings. The lowest are those of the GPU machine, the highest those pinned for CI in
constraints.txt. These tests fail when the suite runs on versions outside that range
(widen it only after the whole suite passed there), when the CI pins drift out of it, and
when pyproject.toml or the README promise something else.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import triton
from packaging.requirements import Requirement
from packaging.version import Version

import ttx_tutorial

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torch", "triton")
RUNNING = {"torch": torch.__version__, "triton": triton.__version__}


def major_minor(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as '2.13.0+cpu' or '3.6'."""
    release = Version(version).release
    return release[0], release[1] if len(release) > 1 else 0


def declared_range(package: str) -> tuple[tuple[int, int], tuple[int, int]]:
    lowest, highest = ttx_tutorial.COMPATIBILITY[package]
    return major_minor(lowest), major_minor(highest)


def constraint_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[name.strip().lower()] = version.strip()
    return pins


def test_compatibility_declares_an_ordered_range_for_torch_and_triton():
    assert set(PACKAGES) <= set(ttx_tutorial.COMPATIBILITY), (
        f"ttx_tutorial.COMPATIBILITY must declare {PACKAGES}, has {sorted(ttx_tutorial.COMPATIBILITY)}"
    )
    for package in PACKAGES:
        lowest, highest = declared_range(package)
        assert lowest <= highest, f"{package}: lowest tested {lowest} is above highest tested {highest}"


@pytest.mark.parametrize("package", PACKAGES)
def test_running_version_lies_in_the_tested_range(package):
    lowest, highest = declared_range(package)
    running = major_minor(RUNNING[package])
    assert lowest <= running <= highest, (
        f"{package} {RUNNING[package]} is outside the tested range "
        f"{ttx_tutorial.COMPATIBILITY[package]}: run the whole suite on it (CPU and GPU), "
        "then widen ttx_tutorial.COMPATIBILITY and the README's compatibility section"
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_ci_pins_lie_in_the_tested_range(package):
    pins = constraint_pins()
    assert package in pins, f"constraints.txt pins no exact version of {package}"
    lowest, highest = declared_range(package)
    assert lowest <= major_minor(pins[package]) <= highest, (
        f"constraints.txt pins {package}=={pins[package]}, outside the tested range "
        f"{ttx_tutorial.COMPATIBILITY[package]}"
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_pyproject_does_not_promise_untested_versions(package):
    text = (ROOT / "pyproject.toml").read_text()
    dependencies = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.S | re.M).group(1)
    requirements = [Requirement(item) for item in re.findall(r'"([^"]+)"', dependencies)]
    [requirement] = [r for r in requirements if r.name.lower() == package]
    lower_bounds = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==", "~=")]
    assert lower_bounds, f"pyproject.toml gives {package} no lower bound: {requirement}"
    lowest, _ = declared_range(package)
    assert major_minor(str(max(lower_bounds))) >= lowest, (
        f"pyproject.toml accepts {requirement}, but the lowest tested {package} is "
        f"{ttx_tutorial.COMPATIBILITY[package][0]}: raise the bound or test the older version"
    )


def test_readme_states_the_tested_versions():
    readme = ROOT / "README.md"
    assert readme.exists(), "README.md is missing; it must state the tested torch and triton versions"
    text = readme.read_text()
    for package in PACKAGES:
        for version in ttx_tutorial.COMPATIBILITY[package]:
            assert re.search(rf"{package}\W[^\n]*\b{re.escape(version)}\b", text, re.I), (
                f"README.md never states {package} {version} (from ttx_tutorial.COMPATIBILITY) "
                "on one line with the package name"
            )
