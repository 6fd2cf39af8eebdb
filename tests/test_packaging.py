"""The ways of installing and running the project stay in step with each other.

pyproject.toml is the one list of dependencies. environment.yml (conda), the Makefile
(venv) and constraints.txt (the exact versions CI installs) must agree with it, and the
distributions built from them must hold and install what they need.
"""

import os
import re
import shutil
import subprocess
import sys
import tarfile
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


def test_environment_yml_installs_the_package_with_the_makefile_extras_and_pins(
        environment, makefile_extras, pyproject):
    (pip_section,) = [entry["pip"] for entry in environment["dependencies"] if isinstance(entry, dict)]
    # nothing else: pyproject.toml lists the dependencies, constraints.txt pins them as for make
    constraint, package = pip_section
    assert constraint.split() == ["-c", "constraints.txt"], (
        f"environment.yml's pip section should start with -c constraints.txt, got {constraint!r}")
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


def test_installs_show_progress_and_cpu_1_takes_the_cpu_build_of_torch():
    """A multi-GB first install must not look frozen; `make lab CPU=1` is the no-GPU route."""
    lines = [line for line in (ROOT / "Makefile").read_text().splitlines() if "pip install" in line]
    assert lines and all("--quiet" not in line and "--progress-bar on" in line for line in lines)
    (cpu_line,) = [line for line in lines if "$(TORCH_CPU_INDEX)" in line]
    assert cpu_line.strip().startswith("$(if $(CPU),") and "-c constraints.txt" in cpu_line
    assert "https://download.pytorch.org/whl/cpu" in (ROOT / "Makefile").read_text()


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


# --- the built distributions -----------------------------------------------------------------

# What a source distribution must hold to run its own tests and install as the README says.
SDIST_MUST_HOLD = ("tests/conftest.py", "tests/_strategies.py", "notebooks/conftest.py",
                   "notebooks/nbval_sanitize.cfg", "Makefile", "constraints.txt", "environment.yml",
                   "CHANGELOG.md", "README.md", "LICENSE", "ttx_tutorial/py.typed",
                   "ttx_tutorial/course/data/h200.json", "notebooks/exercises/INSTRUCTOR.md")
# Left out of the copy the distributions are built from: environments, caches, build outputs.
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "*.egg-info", "build", "dist", "__pycache__",
                                    ".pytest_cache", ".hypothesis", ".ipynb_checkpoints", "results")


# The instructors' guide, copied out with the notebooks (README: "Instructors: see ...").
INSTRUCTORS_GUIDE = "exercises/INSTRUCTOR.md"


def repository_notebooks():
    """Every notebook of the course (exercises included), relative to notebooks/."""
    folder = ROOT / "notebooks"
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*.ipynb")
                  if ".ipynb_checkpoints" not in path.parts)


def run_checked(command, **kwargs):
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def unpacked_sdist(tmp_path_factory):
    """The sdist built from a copy of this tree (the tree itself stays untouched), unpacked."""
    work = tmp_path_factory.mktemp("sdist")
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    run_checked([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                 "print(build_meta.build_sdist(sys.argv[1]))", str(work)], cwd=source)
    (archive,) = work.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(work / "unpacked", filter="data")
    (unpacked,) = (work / "unpacked").iterdir()
    return unpacked


def test_the_sdist_holds_what_its_tests_and_installs_need(unpacked_sdist):
    missing = [name for name in SDIST_MUST_HOLD if not (unpacked_sdist / name).is_file()]
    assert not missing, f"the sdist lacks {missing}"
    tests_here = sorted(path.name for path in (ROOT / "tests").glob("*.py"))
    assert sorted(path.name for path in (unpacked_sdist / "tests").glob("*.py")) == tests_here
    shipped = sorted(str(path.relative_to(unpacked_sdist / "notebooks"))
                     for path in (unpacked_sdist / "notebooks").rglob("*.ipynb"))
    assert shipped == repository_notebooks()


def test_a_wheel_in_a_fresh_environment_copies_out_notebooks_that_run(unpacked_sdist, tmp_path):
    """The route of a pip user: the wheel (built from the sdist) installed in a new virtual
    environment outside the repository, ``python -m ttx_tutorial notebooks DEST``, then nbval.

    The environment sees this one's site-packages through a .pth file for torch, triton and
    Jupyter, so nothing is downloaded. Every copied notebook must equal the repository's, which
    the suite runs under nbval; the first one is run here again, from the wheel, in CPU mode.
    """
    wheels = tmp_path / "wheels"
    run_checked([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                 "--quiet", "-w", str(wheels), str(unpacked_sdist)])
    (wheel,) = wheels.glob("*.whl")

    # Nothing of this process's import path: the wheel alone provides ttx_tutorial there.
    env = {name: value for name, value in os.environ.items()
           if name not in ("PYTHONPATH", "TRITON_INTERPRET", "TTX_TUTORIAL_DEVICE")}
    env["TTX_TUTORIAL_DEVICE"] = "cpu"
    venv = tmp_path / "venv"
    run_checked([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    run_checked([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                 "--no-index", "--quiet", str(wheel)], env=env, cwd=tmp_path)
    purelib = run_checked([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
    this_purelib = subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                  capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib.stdout.strip()) / "outer_site_packages.pth").write_text(this_purelib + "\n")

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    where = run_checked([str(python), "-c", "import ttx_tutorial; print(ttx_tutorial.__file__)"],
                        cwd=outside, env=env)
    installed = Path(where.stdout.strip()).parent
    assert installed.is_relative_to(venv), f"imported {installed} instead of the wheel"
    modules = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "ttx_tutorial").rglob("*.py")
                     if "__pycache__" not in path.parts)
    missing = [name for name in modules if not (installed.parent / name).is_file()]
    assert not missing, f"the wheel lacks {missing}"
    assert (installed / "py.typed").is_file() and (installed / "course" / "data" / "h200.json").is_file()

    destination = outside / "my notebooks"
    run_checked([str(python), "-m", "ttx_tutorial", "notebooks", str(destination)], cwd=outside, env=env)
    copied = sorted(str(path.relative_to(destination)) for path in destination.rglob("*.ipynb"))
    assert copied == repository_notebooks()
    for name in [*copied, INSTRUCTORS_GUIDE]:
        assert (destination / name).read_bytes() == (ROOT / "notebooks" / name).read_bytes(), name

    again = subprocess.run([str(python), "-m", "ttx_tutorial", "notebooks", str(destination)],
                           cwd=outside, env=env, capture_output=True, text=True)
    assert again.returncode == 1 and "--overwrite" in again.stderr, "an existing notebook was replaced"

    # nbval's settings of this repository (stderr never compared, addresses masked), then one run.
    shutil.copyfile(ROOT / "notebooks" / "conftest.py", destination / "conftest.py")
    first = destination / copied[0]
    run_checked([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                 "--nbval-lax", f"--nbval-sanitize-with={ROOT / 'notebooks' / 'nbval_sanitize.cfg'}",
                 f"--rootdir={destination}", str(first)], cwd=outside, env=env)


def test_notebooks_copy_out_of_this_installation(tmp_path):
    """``python -m ttx_tutorial notebooks DEST`` from the installation the tests run in (an
    editable install of the repository under make test, whose import finder does not map
    ``ttx_tutorial.notebooks``): every notebook of the repository, byte for byte, and a second
    copy refused without --overwrite."""
    from ttx_tutorial.__main__ import main

    repository = ROOT / "notebooks"
    expected = sorted(str(p.relative_to(repository)) for p in repository.rglob("*.ipynb")
                      if not any(part.startswith(".") for part in p.relative_to(repository).parts))
    assert main(["notebooks", str(tmp_path)]) == 0
    copied = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.ipynb"))
    assert copied == expected
    assert all((tmp_path / name).read_bytes() == (repository / name).read_bytes()
               for name in [*expected, INSTRUCTORS_GUIDE])
    assert main(["notebooks", str(tmp_path)]) == 1
