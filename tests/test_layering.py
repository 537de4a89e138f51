"""The package layering, read from the source: each package imports only those below it.

    precast (errors, options) < artifact < runtime < ir < passes < targets < compiler < cli

An import inside a function counts as much as one at the top of a module (that is how the old cycle
compiler <-> passes <-> targets hid). The runtime's rule (numpy + the artifact's backend, never torch or
the compiler) is checked twice: statically here, and by importing every runtime module in a process where
the compiler's stack cannot be imported.
"""

from __future__ import annotations

import ast
import pkgutil
from pathlib import Path

import precast
from tests.helpers import run_with_imports_blocked

ROOT = Path(__file__).resolve().parent.parent
# folder -> (package, layer); a package may import its own layer or lower ones
LAYERS = {
    "precast": ("precast", 0),
    "artifact": ("precast.artifact", 1),
    "runtime": ("precast.runtime", 2),
    "ir": ("precast.ir", 3),
    "passes": ("precast.passes", 4),
    "targets": ("precast.targets", 5),
    "compiler": ("precast.compiler", 6),
    "cli": ("precast.cli", 7),
}
BY_PACKAGE = {pkg: (folder, layer) for folder, (pkg, layer) in LAYERS.items()}
# modules of the top-level precast package that are layer 0 (anything may import them)
BASE = {"precast", "precast.errors", "precast.options"}


def _package_of(module: str) -> str | None:
    if module in BASE:
        return "precast"
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 and ".".join(parts[:2]) in BY_PACKAGE else None


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    return out


def _edges():
    for folder, (pkg, layer) in LAYERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "__main__.py":  # `python -m precast`: the entry point, above every layer
                continue
            for lineno, module in _imports(path):
                if not module.startswith("precast"):
                    continue
                target = _package_of(module)
                if target is None:  # `from precast.x import name` where precast.x.name is not a module
                    continue
                yield f"{path.relative_to(ROOT)}:{lineno}", pkg, layer, module, target


def test_each_package_imports_only_the_layers_below_it():
    wrong = [
        f"{where}: {pkg} imports {module}"
        for where, pkg, layer, module, target in _edges()
        if BY_PACKAGE[target][1] > layer
    ]
    assert not wrong, "\n".join(wrong)


def test_the_layering_is_read_from_every_package():
    """The check above must see the imports it rules on (an empty walk would pass anything)."""
    seen = {(pkg, target) for _, pkg, _, _, target in _edges()}
    for pair in [
        ("precast.runtime", "precast.artifact"),
        ("precast.passes", "precast.ir"),
        ("precast.targets", "precast.ir"),
        ("precast.compiler", "precast.targets"),
        ("precast.cli", "precast.compiler"),
    ]:
        assert pair in seen, pair
    assert len(list(pkgutil.iter_modules(precast.__path__))) >= 3


def test_every_runtime_module_imports_without_the_compiler_stack():
    """Every backend, the staged runners, the LLM engine and the server: imported in a process where torch,
    transformers, onnx_ir, onnxscript and precast's compiler side cannot be imported."""
    r = run_with_imports_blocked(
        """
        import importlib, pkgutil
        import precast.runtime as rt
        names = [m.name for m in pkgutil.walk_packages(rt.__path__, "precast.runtime.")]
        for name in names:
            importlib.import_module(name)
        bad = [k for k in sys.modules if k.split(".")[0] in ("torch", "transformers", "onnx_ir", "onnxscript")]
        assert not bad, bad
        print("IMPORTED", len(names))
        """,
        blocked=(
            "torch",
            "transformers",
            "onnx_ir",
            "onnxscript",
            "precast.ir",
            "precast.compiler",
            "precast.passes",
            "precast.targets",
            "precast.cli",
        ),
    )
    assert "IMPORTED" in r.stdout, r.stderr
    assert int(r.stdout.split("IMPORTED")[1].split()[0]) > 60


def test_moved_modules_answer_under_their_old_names():
    """Code written before the layout (a Triton repository's model.py, users' scripts) imports the errors and
    the manifest reader from precast.runtime: every name, not only the exported ones, still answers there."""
    import precast.artifact.manifest as manifest
    import precast.errors as errors
    from precast.runtime.errors import EXIT_USAGE, IntegrityError, first_line
    from precast.runtime.manifest import read_manifest, sha256_file

    assert (EXIT_USAGE, IntegrityError, first_line) == (errors.EXIT_USAGE, errors.IntegrityError, errors.first_line)
    assert (read_manifest, sha256_file) == (manifest.read_manifest, manifest.sha256_file)
