"""The package's layers: the library (API, validation, references, kernels) imports none of the
course's tools that reach into Triton's internals, and the API's dependency on the kernel files
is a plain import."""

import ttx_tutorial
from ttx_tutorial import references
from ttx_tutorial.kernels import chunked, recurrent, scan
from ttx_tutorial.testing import run_python

IMPORTED_BY_THE_PACKAGE = """
import sys
import ttx_tutorial
print(" ".join(sorted(name for name in sys.modules if name.startswith("ttx_tutorial"))))
"""


def test_importing_the_package_leaves_out_the_compiler_probe_and_the_tracer():
    result = run_python(IMPORTED_BY_THE_PACKAGE, timeout=120, TTX_TUTORIAL_DEVICE="cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    modules = set(result.stdout.split())
    assert "ttx_tutorial.api" in modules, "the child did not report the package's modules"
    for course_tool in ("ttx_tutorial.course.compiler", "ttx_tutorial.course.trace", "ttx_tutorial.course.figures",
                        "ttx_tutorial.exercises"):
        assert course_tool not in modules, f"import ttx_tutorial imported {course_tool}"


def test_the_method_table_holds_the_kernel_files_functions():
    for name, module in (("recurrent", recurrent), ("chunked", chunked), ("scan", scan)):
        # the entry for checked inputs: the API has made the checks
        assert ttx_tutorial.method_info(name).function is module._run_validated
    for name in ("loop", "cumsum", "quadratic"):
        assert ttx_tutorial.method_info(name).function is getattr(references, name)

