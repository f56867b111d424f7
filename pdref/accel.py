"""Compiled builds of the simulator's hot modules, used only while they match their sources.

`scripts/build_compiled.py` compiles the modules in `COMPILED` with Cython, unchanged and
untyped (so they compute exactly what the Python does), into
`build/compiled/<cache tag>/`, and writes a manifest of each source's SHA-256 last. A
package's `__init__` puts its compiled folder ahead of its own (`compiled_path`) only when
every compiled source of that package still hashes as in the manifest: an edited module
runs as Python until the next build, never as a stale binary. `PD_PURE_PYTHON=1` turns
the compiled modules off. Nothing here imports anything but the standard library.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

# the hot path of `pdsim run` (a profile's top files); models.py reads its own __file__
COMPILED = {
    "pdref": ("fast_monitor", "mirror_apply", "mirror", "intervals", "plan", "pool",
              "progress", "metrics", "monitor", "rows", "span_ids", "mirror_hybrid", "hybrid",
              "kinds", "mirror_cache", "cache", "cache_apply"),
    "pdsim.core": ("producer", "job", "sender", "decoder", "decode_record", "decode_window",
                   "env", "copier", "sim", "steps", "metrics", "serving_metrics", "workload",
                   "running", "stream", "quantiles", "prefix_cache"),
}
MANIFEST = "manifest.json"
PURE_ENV = "PD_PURE_PYTHON"


def repo_root() -> Path:
    """The folder that holds the pdref and pdsim sources."""
    return Path(__file__).resolve().parent.parent


def build_dir(root: Path) -> Path:
    """Where this interpreter's compiled modules live under `root`."""
    return root / "build" / "compiled" / sys.implementation.cache_tag


def source_file(root: Path, package: str, module: str) -> Path:
    return root.joinpath(*package.split("."), f"{module}.py")


def source_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_manifest(root: Path) -> dict | None:
    """The manifest's module hashes ("pkg.module" -> sha256), or None without a build."""
    try:
        return json.loads((build_dir(root) / MANIFEST).read_text(encoding="utf-8"))["modules"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def stale_modules(root: Path, package: str) -> list[str] | None:
    """The package's compiled modules whose source changed since the build (empty: all
    current); None when there is no build for this interpreter."""
    built = read_manifest(root)
    if built is None:
        return None
    stale = []
    for module in COMPILED[package]:
        name, path = f"{package}.{module}", source_file(root, package, module)
        if not path.is_file() or built.get(name) != source_hash(path):
            stale.append(name)
    return stale


def compiled_path(package: str, path: list[str]) -> list[str]:
    """`path` (a package's `__path__`) with its compiled folder first when that is current."""
    if os.environ.get(PURE_ENV) or package not in COMPILED:
        return path
    root = Path(path[0]).parents[package.count(".")]
    if stale_modules(root, package) != []:
        return path
    folder = build_dir(root).joinpath(*package.split("."))
    return [str(folder), *path] if folder.is_dir() else path


def status() -> dict:
    """What a run of this checkout uses, per package: "compiled", "pure (PD_PURE_PYTHON)",
    "pure (no build)" or "pure (stale: ...)" (bench/sim_speed.py reports it)."""
    root, out = repo_root(), {}
    for package in COMPILED:
        stale = stale_modules(root, package)
        if os.environ.get(PURE_ENV):
            out[package] = f"pure ({PURE_ENV})"
        elif stale is None:
            out[package] = "pure (no build)"
        elif stale:
            out[package] = f"pure (stale: {', '.join(stale)})"
        else:
            out[package] = "compiled"
    return out
