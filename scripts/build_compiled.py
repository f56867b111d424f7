"""Compile the simulator's hot modules (pdref/accel.py: COMPILED) with Cython.

    python scripts/build_compiled.py            # when a source changed since the last build
    python scripts/build_compiled.py --force    # always
    python scripts/build_compiled.py --clean    # remove the build: everything runs as Python

The modules are compiled as they are (no type declarations), so a compiled run computes
exactly what the Python computes, only faster; tests/test_pdref_accel.py compares the two. The
build goes to a temporary folder and replaces the old one only when complete, its
manifest written last: a failed build leaves the previous one or none, never half of one.
Exit status 1 when the compiler or Cython is missing or compilation fails (the modules
then run as Python, as before).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pdref.accel import (  # noqa: E402  (the sources of this checkout, not an installed copy)
    COMPILED,
    MANIFEST,
    build_dir,
    repo_root,
    source_file,
    source_hash,
    stale_modules,
)


def up_to_date(root: Path) -> bool:
    return all(stale_modules(root, package) == [] for package in COMPILED)


def compile_into(root: Path, target: Path, jobs: int) -> dict[str, str]:
    """Compile every COMPILED module into `target`; the sources' hashes, taken first."""
    from Cython.Build import cythonize
    from setuptools import Extension, setup

    hashes, extensions = {}, []
    for package, modules in COMPILED.items():
        for module in modules:
            name, path = f"{package}.{module}", source_file(root, package, module)
            hashes[name] = source_hash(path)
            extensions.append(Extension(name, [str(path.relative_to(root))],
                                        extra_compile_args=["-g0", "-w"]))
    generated = root / "build" / "cython"
    modules = cythonize(extensions, build_dir=str(generated), language_level=3, quiet=True,
                        nthreads=jobs, compiler_directives={"binding": True})
    setup(name="pdhandoff-compiled", ext_modules=modules, script_args=[
        "-q", "build_ext", "--build-lib", str(target), "--build-temp", str(generated / "obj"),
        "--parallel", str(jobs)])
    return hashes


def build(root: Path, jobs: int) -> Path:
    final = build_dir(root)
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    cwd = os.getcwd()
    os.chdir(root)  # setuptools resolves the sources' relative paths from here
    try:
        hashes = compile_into(root, partial, jobs)
    finally:
        os.chdir(cwd)
    (partial / MANIFEST).write_text(json.dumps({"modules": hashes}, indent=1) + "\n",
                                    encoding="utf-8")
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    return final


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--force", action="store_true", help="build even when up to date")
    p.add_argument("--clean", action="store_true", help="remove the build and stop")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs: must be at least 1, got {args.jobs}")
    root = repo_root()
    if args.clean:
        shutil.rmtree(build_dir(root), ignore_errors=True)
        print(f"build_compiled: removed {build_dir(root)}")
        return 0
    if not args.force and up_to_date(root):
        print("build_compiled: up to date")
        return 0
    count = sum(len(m) for m in COMPILED.values())
    print(f"build_compiled: compiling {count} modules with Cython (about a minute) ...",
          flush=True)
    start = time.perf_counter()
    try:
        final = build(root, args.jobs)
    except (ImportError, SystemExit, Exception) as e:  # noqa: BLE001 (any failure: say it)
        left = ("the previous build, still current, is used" if up_to_date(root)
                else "the modules run as Python")
        reason = " ".join(str(e).split())[:300]
        print(f"build_compiled: failed ({type(e).__name__}: {reason}); {left}", file=sys.stderr)
        return 1
    print(f"build_compiled: {count} modules in {final} ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
