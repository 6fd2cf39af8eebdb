"""The ways of installing and running the project stay in step with each other.

pyproject.toml is the one list of dependencies. environment.yml (conda), the Makefile
(venv) and constraints.txt (the exact versions CI installs) must agree with it, and
importing the package must pick the device mode without touching the GPU driver.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

import ttx_tutorial

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = Path(__file__).resolve().parent.parent

# Versions that decide what the tests and notebooks see: CI must install exactly these.
MUST_BE_PINNED = ("torch", "triton", "numpy", "nbval", "jupyterlab")


@pytest.fixture(scope="module")
def pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


@pytest.fixture(scope="module")
def direct_requirements(pyproject):
    """Every requirement of pyproject.toml, its extras included, by canonical name."""
    lines = list(pyproject["dependencies"])
    for extra in pyproject["optional-dependencies"].values():
        lines += extra
    return {canonicalize_name(r.name): r for r in map(Requirement, lines)}


@pytest.fixture(scope="module")
def constraints():
    """constraints.txt as {canonical name: Requirement}."""
    lines = (line.split("#", 1)[0].strip() for line in (ROOT / "constraints.txt").read_text().splitlines())
    requirements = [Requirement(line) for line in lines if line]
    return {canonicalize_name(r.name): r for r in requirements}


@pytest.fixture(scope="module")
def makefile_install_line():
    """The Makefile's ``pip install ... -e ".[extras]"`` line."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    (install_line,) = [line for line in lines if "pip install" in line and " -e " in line]
    return install_line


@pytest.fixture(scope="module")
def makefile_extras(makefile_install_line):
    (extras,) = re.findall(r"-e\s+\"?\.\[([^\]]*)\]", makefile_install_line)
    return {extra.strip() for extra in extras.split(",")}


@pytest.fixture(scope="module")
def environment():
    return yaml.safe_load((ROOT / "environment.yml").read_text())


def test_environment_yml_takes_only_python_and_pip_from_conda(environment):
    conda_names = {re.split(r"[=<>!\s]", entry, maxsplit=1)[0]
                   for entry in environment["dependencies"] if isinstance(entry, str)}
    assert conda_names == {"python", "pip"}
    assert environment["channels"] == ["conda-forge"]


def test_environment_yml_python_satisfies_requires_python(environment, pyproject):
    (python_entry,) = [entry for entry in environment["dependencies"]
                       if isinstance(entry, str) and entry.startswith("python")]
    match = re.fullmatch(r"python\s*=\s*(\d+\.\d+)", python_entry)
    assert match, f"environment.yml should choose one Python version, like python=3.11; got {python_entry!r}"
    requires_python = pyproject["requires-python"]
    assert Version(match[1]) in Requirement(f"python{requires_python}").specifier, (
        f"environment.yml's {python_entry} does not satisfy requires-python {requires_python}")


def test_environment_yml_installs_the_package_with_the_makefile_extras(
        environment, makefile_extras, pyproject):
    (pip_section,) = [entry["pip"] for entry in environment["dependencies"] if isinstance(entry, dict)]
    (package,) = pip_section  # nothing else: pyproject.toml lists the dependencies
    match = re.fullmatch(r"-e\s+\.\[([^\]]*)\]", package.strip())
    assert match, f"environment.yml should install the package as -e .[extras], got {package!r}"
    extras = {extra.strip() for extra in match[1].split(",")}
    assert extras == makefile_extras
    assert extras <= set(pyproject["optional-dependencies"])


def test_constraints_pin_exact_versions(constraints):
    for name, requirement in constraints.items():
        operators = [specifier.operator for specifier in requirement.specifier]
        assert operators == ["=="], f"constraints.txt must pin {name} exactly, got {requirement}"


def test_the_makefile_installs_the_pinned_versions(makefile_install_line):
    assert "-c constraints.txt" in makefile_install_line


def test_every_direct_dependency_is_pinned_within_its_range(constraints, direct_requirements):
    for name in MUST_BE_PINNED:
        assert name in constraints, f"constraints.txt must pin {name}"
    for name, requirement in direct_requirements.items():
        assert name in constraints, f"{requirement} is a dependency but constraints.txt does not pin it"
        (pin,) = constraints[name].specifier
        assert requirement.specifier.contains(pin.version, prereleases=True), (
            f"constraints.txt pins {constraints[name]}, outside pyproject's {requirement}")


def test_ci_runs_make_test():
    script = ROOT / ".ci" / "run"
    assert os.access(script, os.X_OK), ".ci/run must be executable"
    commands = [line.strip() for line in script.read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert "make test" in commands


def test_methods_include_the_three_references():
    assert {"loop", "cumsum", "quadratic"} <= set(ttx_tutorial.METHODS)
    assert len(set(ttx_tutorial.METHODS)) == len(ttx_tutorial.METHODS)


# --- device mode, decided at import --------------------------------------------------------

REPORT_MODE = """
import json, os
import ttx_tutorial, torch
print(json.dumps({
    "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
    "interpreted": ttx_tutorial.INTERPRETED,
    "device": str(ttx_tutorial.DEVICE),
    "cuda_initialized": torch.cuda.is_initialized(),
    "describe": ttx_tutorial.describe(),
}))
"""


def import_in_subprocess(**environment):
    """Import ttx_tutorial in a fresh interpreter with only the given mode variables set."""
    env = {name: value for name, value in os.environ.items()
           if name not in ("TRITON_INTERPRET", "TTX_TUTORIAL_DEVICE")}  # this process set them
    env.update(environment)
    return subprocess.run([sys.executable, "-c", REPORT_MODE], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_cpu_mode_turns_on_the_interpreter_without_touching_cuda():
    result = import_in_subprocess(TTX_TUTORIAL_DEVICE="cpu")
    assert result.returncode == 0, result.stderr
    mode = json.loads(result.stdout)
    assert mode["TRITON_INTERPRET"] == "1"
    assert mode["interpreted"] is True
    assert mode["device"] == "cpu"
    assert mode["cuda_initialized"] is False
    assert mode["describe"].split(" | ")[1].startswith("CPU mode")


def test_an_explicit_triton_interpret_wins_over_the_device_choice():
    result = import_in_subprocess(TTX_TUTORIAL_DEVICE="cuda", TRITON_INTERPRET="1")
    assert result.returncode == 0, result.stderr
    mode = json.loads(result.stdout)
    assert mode["interpreted"] is True and mode["device"] == "cpu"
    assert "TRITON_INTERPRET was set by the user" in mode["describe"]


def test_an_invalid_device_choice_is_a_clear_error():
    result = import_in_subprocess(TTX_TUTORIAL_DEVICE="tpu")
    assert result.returncode != 0
    assert "ValueError: TTX_TUTORIAL_DEVICE must be one of ('cpu', 'cuda'), got 'tpu'" in result.stderr
