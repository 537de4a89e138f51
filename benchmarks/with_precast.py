"""Run a benchmark script with `precast` imported from another installed tree (an older commit).

    git worktree add /tmp/before REV
    pip install --no-deps --no-build-isolation --target /tmp/oldpkg /tmp/before
    python benchmarks/with_precast.py /tmp/oldpkg /tmp/before/benchmarks/bench_llm.py [its options]

PYTHONPATH alone does not do it: a checkout's `precast/` holds only `__init__.py` (pyproject maps the other
folders into the namespace), so `precast.runtime` falls through to the editable install's finder and the
current code runs unnoticed. This drops that finder, imports precast from TREE before the script puts its own
checkout on sys.path, and refuses to run if any precast module comes from elsewhere.
"""

from __future__ import annotations

import importlib
import runpy
import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit("usage: with_precast.py TREE SCRIPT [ARGS...]")
    tree, script, args = Path(sys.argv[1]).resolve(), sys.argv[2], sys.argv[3:]
    if not (tree / "precast" / "runtime").is_dir():
        sys.exit(f"{tree}: no installed precast tree (precast/runtime missing); pip install --target it")
    editable = lambda f: getattr(f, "__module__", "").startswith("__editable__")  # noqa: E731
    sys.meta_path[:] = [f for f in sys.meta_path if not editable(f)]
    sys.path_hooks[:] = [h for h in sys.path_hooks if not editable(h)]
    sys.path_importer_cache.clear()
    sys.path.insert(0, str(tree))
    for name in ("precast", "precast.runtime", "precast.compiler", "precast.passes", "precast.targets"):
        mod = importlib.import_module(name)
        if not Path(mod.__file__).resolve().is_relative_to(tree):
            sys.exit(f"{name} resolves to {mod.__file__}, not under {tree}")
    print(f"precast from {tree}", flush=True)
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        stray = sorted(
            m.__name__
            for m in list(sys.modules.values())
            if getattr(m, "__name__", "").startswith("precast")
            and getattr(m, "__file__", None)
            and not Path(m.__file__).resolve().is_relative_to(tree)
        )
        if stray:
            sys.exit(f"precast modules imported from outside {tree}: {', '.join(stray)}")


if __name__ == "__main__":
    main()
