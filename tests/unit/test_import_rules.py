"""The import rule of ARCHITECTURE.md, checked on the source: no service imports another
service's package (`services.X` never imports `services.Y`), and neither `shared/` nor
`meshllm_kernels/` imports `services/`. What two services share lives in shared/ or
meshllm_kernels/.

Every import counts: top level, inside functions, under `if TYPE_CHECKING:`, relative ones, and
`importlib.import_module("...")` / `__import__("...")` with a literal name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("services", "meshllm_kernels", "shared")

KNOWN_VIOLATIONS: set[str] = set()  # none: keep it that way


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_names(module: str, source: str, *, is_package: bool = False) -> list[str]:
    """Every module name `source` (the text of `module`) imports, absolute. For `from M import
    a`, the name is `M.a`: `a` may be a submodule (`from services import gateway`)."""
    package = module if is_package else module.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names += [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func):
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                names.append(first.value)
    return names


def _is_dynamic_import(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in ("__import__", "import_module")
    return isinstance(func, ast.Attribute) and func.attr == "import_module"


def violations(module: str, source: str, *, is_package: bool = False) -> list[str]:
    """`module -> imported` for each import that breaks the rule."""
    owner = module.split(".")
    bad = []
    for name in imported_names(module, source, is_package=is_package):
        target = name.split(".")
        if target[0] != "services":
            continue
        library = owner[0] in ("shared", "meshllm_kernels")
        other_service = owner[0] == "services" and len(owner) > 1 and target[1:2] != owner[1:2]
        if library or other_service:
            bad.append(f"{module} -> {name}")
    return bad


def python_files() -> list[Path]:
    return sorted(p for top in CHECKED for p in (ROOT / top).rglob("*.py"))


def test_the_tree_keeps_the_import_rule() -> None:
    files = python_files()
    assert len(files) > 100  # the walk found the tree
    found = []
    for path in files:
        source = path.read_text(encoding="utf-8")
        found += violations(module_name(path), source, is_package=path.name == "__init__.py")
    assert sorted(found) == sorted(KNOWN_VIOLATIONS)


@pytest.mark.parametrize(
    ("module", "source", "bad"),
    [
        ("services.gateway.frontend", "import services.scheduler.request", True),
        ("services.gateway.frontend", "from services.worker.models import llama", True),
        ("services.gateway.frontend", "from services import scheduler", True),
        ("services.gateway.frontend", "def f():\n    from services.kvstore import lru\n", True),
        (
            "services.gateway.frontend",
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from services.grammar.service import GrammarService\n",
            True,
        ),
        ("services.gateway.api.routes", "from ...scheduler import scheduler", True),
        ("services.gateway.api.routes", "from ..frontend import Frontend", False),
        ("services.gateway.api.routes", "from . import errors", False),
        ("services.kvstore.lru", "importlib.import_module('services.worker.service')", True),
        ("services.kvstore.service", "import_module('services.kvstore.lru')", False),
        ("services.gateway.frontend", "from services.gateway.api import errors", False),
        ("services.gateway.frontend", "from shared.bus import Bus\nimport meshllm_kernels", False),
        ("shared.bus", "from services.gateway import frontend", True),
        ("shared.model.source", "def f():\n    import services\n", True),
        ("shared.protocol", "from .health import Heartbeat", False),
        (
            "meshllm_kernels.attention.paged_decode",
            "from services.worker.attention import select",
            True,
        ),
        (
            "meshllm_kernels.attention.paged_decode",
            "from meshllm_kernels.runtime import tensor_checks",
            False,
        ),
    ],
)
def test_the_checker_catches_each_kind_of_import(module: str, source: str, bad: bool) -> None:
    is_package = module == "shared.protocol"  # shared/protocol/__init__.py
    assert bool(violations(module, source, is_package=is_package)) is bad
