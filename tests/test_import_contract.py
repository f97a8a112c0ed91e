"""The dependency direction of DESIGN.md, checked on the source (AST, every import, lazy ones too).

* ``gpu_pool`` imports nothing of Ember's (no gateway, scheduler, runtime, bench);
* ``runtime`` imports only ``gpu_pool``'s public surface and never gateway or scheduler;
* ``scheduler`` imports neither gateway nor runtime nor gpu_pool;
* ``gateway`` imports gpu_pool's public surface only (scheduler and runtime as it likes);
* the algorithm modules (``gpu_pool/planner/``, ``runtime/engine/block_manager*``,
  ``scheduler/policies*``) import no torch or CuPy.

The public surface is ``gpu_pool.__all__`` (read from the AST of ``gpu_pool/__init__.py``, so
this test imports nothing it checks). Imports inside functions, classes and ``if`` blocks count
(the whole tree is walked); ``importlib.import_module`` with a computed name is not seen.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EMBER_PACKAGES = ("gateway", "scheduler", "runtime", "gpu_pool", "bench")
ACCELERATOR_LIBS = ("torch", "cupy")


@dataclass(frozen=True)
class Import:
    """One imported module, as an absolute dotted name, and where the import statement is."""

    file: str  # relative to the repository root
    line: int
    module: str


def public_surface() -> frozenset[str]:
    """``gpu_pool.X`` for every X in ``gpu_pool/__init__.py``'s ``__all__``."""
    tree = ast.parse((ROOT / "gpu_pool" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            names = ast.literal_eval(node.value)
            return frozenset(f"gpu_pool.{name}" for name in names)
    raise AssertionError("gpu_pool/__init__.py declares no __all__")


def module_name(path: Path) -> str:
    """``runtime/engine/engine.py`` -> ``runtime.engine.engine`` (packages: their own name)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, file: str, package: str) -> Iterator[Import]:
    """Every module ``source`` imports; ``from a import b`` yields ``a.b`` (b may be a module).

    ``package`` is the dotted package the file lives in, to resolve relative imports.
    """
    for node in ast.walk(ast.parse(source, filename=file)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(file, node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                yield Import(file, node.lineno, base if alias.name == "*" else f"{base}.{alias.name}")


def within(module: str, *packages: str) -> bool:
    """Whether ``module`` is one of ``packages`` or inside one."""
    return any(module == p or module.startswith(p + ".") for p in packages)


def is_public(module: str, surface: frozenset[str]) -> bool:
    """A public gpu_pool module, or a name defined in one (``gpu_pool.client.PoolClient``).

    A public package's own submodules are not public (``gpu_pool.store.trust``)."""
    if module == "gpu_pool" or module in surface:
        return True
    parent, _, _ = module.rpartition(".")
    path = ROOT.joinpath(*module.split("."))
    is_module = path.with_suffix(".py").is_file() or path.is_dir()
    return parent in surface and not is_module


def is_algorithm(file: str) -> bool:
    """The modules that must stay free of torch and CuPy (tested exhaustively on CPU)."""
    name = Path(file).name
    return (
        file.startswith("gpu_pool/planner/")
        or (file.startswith("runtime/engine/") and name.startswith("block_manager"))
        or (file.startswith("scheduler/") and name.startswith("policies"))
    )


def violations(imp: Import, surface: frozenset[str]) -> Iterator[str]:
    """The rules ``imp`` breaks, each as ``file:line: rule: imports module``."""
    owner = imp.file.split("/", 1)[0]
    mod = imp.module

    def broken(rule: str) -> str:
        return f"{imp.file}:{imp.line}: {rule}: imports {mod}"

    if owner == "gpu_pool" and within(mod, *(p for p in EMBER_PACKAGES if p != "gpu_pool")):
        yield broken("gpu_pool imports nothing of Ember's")
    if owner == "runtime" and within(mod, "gateway", "scheduler"):
        yield broken("runtime never imports gateway or scheduler")
    if owner == "scheduler" and within(mod, "gateway", "runtime", "gpu_pool"):
        yield broken("scheduler imports neither gateway nor runtime nor gpu_pool")
    if owner in ("runtime", "gateway") and within(mod, "gpu_pool") and not is_public(mod, surface):
        allowed = ", ".join(sorted(surface))
        yield broken(f"{owner} imports only gpu_pool's public surface ({allowed})")
    if is_algorithm(imp.file) and within(mod, *ACCELERATOR_LIBS):
        yield broken("algorithm modules import no torch or CuPy")


def all_imports() -> Iterator[Import]:
    for package in ("gpu_pool", "runtime", "scheduler", "gateway"):
        for path in sorted((ROOT / package).rglob("*.py")):
            file = path.relative_to(ROOT).as_posix()
            name = module_name(path)
            pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
            yield from imports_of(path.read_text(), file, pkg)


def test_dependency_direction() -> None:
    surface = public_surface()
    broken = [v for imp in all_imports() for v in violations(imp, surface)]
    assert not broken, "import contract (DESIGN.md, Dependency direction) broken:\n" + "\n".join(broken)


def test_public_surface_exists() -> None:
    for module in public_surface():
        path = ROOT.joinpath(*module.split("."))
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), module


def check(source: str, file: str) -> list[str]:
    """The violations of one source text placed at ``file``."""
    pkg = file.removesuffix(".py").replace("/", ".").rpartition(".")[0]
    surface = public_surface()
    return [v for imp in imports_of(source, file, pkg) for v in violations(imp, surface)]


def test_checker_sees_lazy_relative_and_internal_imports() -> None:
    lazy = "def f():\n    if True:\n        from gpu_pool.server.daemon import run\n"
    assert check(lazy, "runtime/x.py") == [
        "runtime/x.py:3: runtime imports only gpu_pool's public surface ("
        + ", ".join(sorted(public_surface()))
        + "): imports gpu_pool.server.daemon.run"
    ]
    assert check("from gpu_pool.store import trust\n", "runtime/x.py")  # public package, internal module
    assert check("import gpu_pool.planner.allocator\n", "gateway/x.py")
    assert check("from gpu_pool import arena\n", "runtime/x.py")
    assert check("from ...gateway import app\n", "gpu_pool/planner/x.py")  # relative, resolved
    assert check("class A:\n    def m(self):\n        import gateway.app\n", "gpu_pool/x.py")
    assert check("from runtime import agent\n", "scheduler/x.py")
    assert check("import torch.nn\n", "runtime/engine/block_manager.py")
    assert check("from cupy import ndarray\n", "gpu_pool/planner/packing.py")
    assert check("import scheduler.state\n", "runtime/x.py")
    ok = (
        "from gpu_pool import store\nfrom gpu_pool.client import PoolClient\n"
        "from gpu_pool.store import write\nimport gpu_pool.errors\nimport numpy\n"
    )
    assert check(ok, "runtime/x.py") == []
    assert check("import torch\n", "runtime/engine/engine.py") == []
