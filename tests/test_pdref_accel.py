"""pdref.accel: compiled modules are used only while they match their sources."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdref import accel

ROOT = Path(__file__).resolve().parent.parent


def fake_checkout(tmp_path: Path, package: str = "pdsim.core") -> Path:
    """A checkout with the package's compiled sources and a build whose manifest matches."""
    hashes = {}
    for pkg, modules in accel.COMPILED.items():
        for module in modules:
            path = accel.source_file(tmp_path, pkg, module)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"# {pkg}.{module}\n", encoding="utf-8")
            hashes[f"{pkg}.{module}"] = accel.source_hash(path)
    build = accel.build_dir(tmp_path)
    build.joinpath(*package.split(".")).mkdir(parents=True)
    (build / accel.MANIFEST).write_text(json.dumps({"modules": hashes}), encoding="utf-8")
    return tmp_path


def package_path(root: Path, package: str) -> list[str]:
    return [str(root.joinpath(*package.split(".")))]


def test_current_build_comes_first(tmp_path, monkeypatch):
    """A build matching every source of the package is searched before the sources."""
    monkeypatch.delenv(accel.PURE_ENV, raising=False)
    root = fake_checkout(tmp_path)
    path = package_path(root, "pdsim.core")
    assert accel.compiled_path("pdsim.core", path) == [
        str(accel.build_dir(root) / "pdsim" / "core"), *path]


def test_edited_source_runs_as_python(tmp_path, monkeypatch):
    """One edited module of the package: its build is not used, and status names it."""
    monkeypatch.delenv(accel.PURE_ENV, raising=False)
    root = fake_checkout(tmp_path)
    accel.source_file(root, "pdsim.core", "decoder").write_text("# edited\n", encoding="utf-8")
    path = package_path(root, "pdsim.core")
    assert accel.compiled_path("pdsim.core", path) == path
    assert accel.stale_modules(root, "pdsim.core") == ["pdsim.core.decoder"]


def test_missing_source_or_manifest_runs_as_python(tmp_path, monkeypatch):
    """No manifest (no build, or one cut short) or a deleted source: the sources only."""
    monkeypatch.delenv(accel.PURE_ENV, raising=False)
    root = fake_checkout(tmp_path)
    accel.source_file(root, "pdsim.core", "env").unlink()
    path = package_path(root, "pdsim.core")
    assert accel.compiled_path("pdsim.core", path) == path
    (accel.build_dir(root) / accel.MANIFEST).write_text("{not json", encoding="utf-8")
    assert accel.stale_modules(root, "pdsim.core") is None


def test_pure_python_switch(tmp_path, monkeypatch):
    """PD_PURE_PYTHON=1 keeps a current build out of the path."""
    root = fake_checkout(tmp_path)
    monkeypatch.setenv(accel.PURE_ENV, "1")
    path = package_path(root, "pdsim.core")
    assert accel.compiled_path("pdsim.core", path) == path


def _run(args: list[str], pure: bool, trace: Path) -> tuple[str, str]:
    """A `pdsim run`'s metrics JSON and trace, compiled or as pure Python."""
    env = dict(os.environ)
    env.pop(accel.PURE_ENV, None)
    if pure:
        env[accel.PURE_ENV] = "1"
    out = subprocess.run([sys.executable, "-m", "pdsim", "run", *args, "--json", "--trace",
                          str(trace)], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True, timeout=300).stdout
    return out, trace.read_text(encoding="utf-8")


RUNS = [
    ["--requests", "300", "--rate", "4", "--prompt-range", "256:4096", "--output-tokens", "9"],
    ["--requests", "60", "--concurrency", "6", "--mode", "layer", "--producers", "2",
     "--output-range", "1:20"],
    ["--requests", "80", "--rate", "3", "--mode", "whole", "--chunk", "128",
     "--prompt-range", "512:2048", "--output-tokens", "4"],
    ["--requests", "80", "--rate", "3", "--producers", "2", "--fail-rate", "0.05",
     "--stall-rate", "0.03", "--span-timeout", "0.5", "--kill-producer", "0@1.0",
     "--restart-producers", "--seed", "3", "--output-tokens", "6"],
]


def _current_build() -> None:
    """Skip only where pure Python was asked for; a build missing or stale otherwise fails
    the test (set-up builds it, and a broken build must not pass as skipped tests)."""
    if os.environ.get(accel.PURE_ENV):
        pytest.skip(f"{accel.PURE_ENV} is set: the modules run as Python")
    status = accel.status()
    assert status == {p: "compiled" for p in accel.COMPILED}, (
        f"no current compiled build ({status}): run scripts/setup.sh (or python "
        f"scripts/build_compiled.py), or set {accel.PURE_ENV}=1 for pure Python")


@pytest.mark.parametrize("args", RUNS, ids=["rate", "concurrency-layer", "whole", "faults"])
def test_compiled_run_equals_python(args, tmp_path):
    """A run on the compiled modules prints and traces exactly what the pure-Python run does."""
    _current_build()
    compiled = _run(args, pure=False, trace=tmp_path / "compiled.jsonl")
    assert compiled == _run(args, pure=True, trace=tmp_path / "pure.jsonl")
    assert len(compiled[1]) > 1000


def test_compiled_modules_are_loaded():
    """With a current build, the hot modules are the compiled ones (not their sources)."""
    _current_build()
    code = "import pdref.mirror_apply as a, pdsim.core.producer as b; print(a.__file__, b.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=120, env={k: v for k, v in os.environ.items()
                                          if k != accel.PURE_ENV}).stdout.split()
    assert all(f.endswith(".so") and "build" in f for f in out), out


def test_build_script_refuses_bad_jobs():
    """scripts/build_compiled.py --jobs 0: one line naming the option, exit 2, nothing built."""
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_compiled.py"), "--jobs",
                          "0"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].endswith("--jobs: must be at least 1, got 0")


def test_build_without_cython_fails_in_one_line_and_keeps_the_build():
    """Where Cython cannot be imported, the build says so in one line (exit 1) and what was
    there before is left as it was."""
    before = accel.status()
    code = ("import runpy, sys; sys.modules['Cython'] = None; "
            "sys.argv = ['build_compiled.py', '--force']; "
            f"runpy.run_path({str(ROOT / 'scripts' / 'build_compiled.py')!r}, "
            "run_name='__main__')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 1
    assert run.stderr.count("\n") == 1
    assert run.stderr.startswith("build_compiled: failed (ModuleNotFoundError")
    assert accel.status() == before


def test_a_missing_build_fails_the_comparison_instead_of_skipping(monkeypatch):
    """Without PD_PURE_PYTHON a missing or stale build is a failure naming the fix."""
    monkeypatch.delenv(accel.PURE_ENV, raising=False)
    monkeypatch.setattr(accel, "status", lambda: {p: "pure (no build)" for p in accel.COMPILED})
    with pytest.raises(AssertionError, match="build_compiled.py"):
        _current_build()
