"""Builds fast-transformers' causal dot product, a peer of the benchmarks, from its source.

    python benchmarks/build_fast_transformers.py --source DIR --target SITE
    PYTHONPATH=SITE:$PYTHONPATH python -m ttx_tutorial.bench --peers fast_transformers_cuda ...

fast-transformers (https://github.com/idiap/fast-transformers, MIT) publishes no wheels, and
its setup.py compiles a dozen CUDA extensions. The benchmarks need one function,
``fast_transformers.causal_product.causal_dot_product``, so this script builds only that module:
DIR is a checkout of the repository (its ``fast_transformers/causal_product/`` folder is read,
nothing else), SITE gets a ``fast_transformers`` package holding the module's ``__init__.py``
unchanged and its two extensions compiled with ``torch.utils.cpp_extension``, with the flags of
the project's setup.py: ``causal_product_cpu`` (``-fopenmp -ffast-math``) and, where nvcc and a
GPU are present, ``causal_product_cuda`` for that GPU's architecture. Without a GPU the module
imports and runs on CPU tensors only. Needs a C++ compiler and ninja; no network. About a
minute per extension.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from torch.utils import cpp_extension

MODULE = Path("fast_transformers") / "causal_product"
CPU_FLAGS = ["-O3", "-fopenmp", "-ffast-math"]


def build(source: Path, target: Path, verbose: bool = False) -> list[str]:
    """Compiles the extensions into ``target``/fast_transformers/causal_product; returns their names."""
    module_source = source / MODULE
    if not (module_source / "__init__.py").is_file():
        raise FileNotFoundError(f"--source {source} holds no {MODULE}/__init__.py: "
                                "pass a checkout of github.com/idiap/fast-transformers")
    package = target / MODULE
    package.mkdir(parents=True, exist_ok=True)
    (package.parent / "__init__.py").write_text(
        '"""fast-transformers\' causal product alone, built by benchmarks/build_fast_transformers.py."""\n')
    shutil.copyfile(module_source / "__init__.py", package / "__init__.py")
    for license_name in ("LICENSE", "LICENSE.txt"):
        if (source / license_name).is_file():
            shutil.copyfile(source / license_name, package.parent / "LICENSE")

    built = []
    extensions = [("causal_product_cpu", "causal_product_cpu.cpp", {"extra_cflags": CPU_FLAGS,
                                                                     "extra_ldflags": ["-fopenmp"]})]
    if torch.cuda.is_available() and cpp_extension.CUDA_HOME is not None:
        major, minor = torch.cuda.get_device_capability()
        arch = f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"
        extensions.append(("causal_product_cuda", "causal_product_cuda.cu", {"extra_cuda_cflags": ["-O3", arch]}))
    for name, file_name, flags in extensions:
        build_directory = target / "build" / name
        build_directory.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(name=name, sources=[str(module_source / file_name)],
                           build_directory=str(build_directory), verbose=verbose, **flags)
        # load() imports the module under its bare name; the package imports it as .name.
        library = next(build_directory.glob(f"{name}*.so"))
        shutil.copyfile(library, package / library.name)
        built.append(name)
    return built


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, required=True, help="a fast-transformers checkout")
    parser.add_argument("--target", type=Path, required=True, help="folder to put on PYTHONPATH")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    args = parser.parse_args(argv)
    built = build(args.source, args.target, args.verbose)
    print(f"built {', '.join(built)} into {args.target / MODULE}")
    if "causal_product_cuda" not in built:
        print("no CUDA extension: no GPU or no nvcc here; causal_dot_product takes CPU tensors only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
