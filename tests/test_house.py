"""The house rules of the tree (issue 9), checked on the source: one concept per file, composed
op families, layers that depend downwards only, and a module map that matches the tree."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "mgserve"
MAX_LINES = 300
# generated tables, not code: their generators and tests say where they come from
GENERATED = {"core/text/unicode_data.py"}


def _modules() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def _rel(p: Path) -> str:
    return p.relative_to(PKG).as_posix()


def _imports(p: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_no_module_is_over_the_size_limit() -> None:
    long = {
        _rel(p): n
        for p in _modules()
        if _rel(p) not in GENERATED
        and (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by concept): {long}"


def test_no_class_in_cuda_has_more_than_one_base() -> None:
    many = []
    for p in (PKG / "cuda").rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                bases = [b for b in bases if b not in ("object", "Protocol")]
                if len(bases) > 1:
                    many.append(f"{_rel(p)}:{node.name}({', '.join(bases)})")
    assert not many, f"classes with several bases (compose instead): {many}"


def test_the_api_never_imports_the_gpu_backend() -> None:
    bad = {
        _rel(p): sorted(i for i in _imports(p) if i.startswith("mgserve.cuda"))
        for p in (PKG / "api").rglob("*.py")
    }
    assert not {k: v for k, v in bad.items() if v}


def test_the_core_reaches_the_gpu_only_through_the_engine_factory() -> None:
    bad = {
        _rel(p): sorted(i for i in _imports(p) if i.startswith("mgserve.cuda"))
        for p in (PKG / "core").rglob("*.py")
        if _rel(p) != "core/engine/factory.py"
    }
    assert not {k: v for k, v in bad.items() if v}


def _map_block(text: str) -> str:
    section = text.split("## Module map", 1)[1]
    return section.split("```", 2)[1]


def test_the_readme_module_map_matches_the_tree() -> None:
    """Every file and folder the map names exists, and every package folder and module of
    mgserve/ is named in it (by name, by a ``prefix*`` pattern, or in a brace group)."""
    block = _map_block((ROOT / "README.md").read_text(encoding="utf-8"))
    names: set[str] = set()
    dirs: list[str] = []
    for line in block.splitlines():
        entry = line.split("  ")[0] if not line.startswith(" ") else line.strip().split("  ")[0]
        entry = entry.strip()
        if not entry:
            continue
        if entry.endswith("/") and " " not in entry:
            dirs.append(entry)
        for tok in re.split(r"[,\s]+", entry):
            if tok:
                names.add(tok.rstrip("/"))
    tree_dirs = {
        _rel(d) for d in PKG.rglob("*") if d.is_dir() and (d / "__init__.py").exists()
    }
    missing_dirs = sorted(
        d for d in tree_dirs if d.split("/")[-1] not in names and d not in names
    )
    assert not missing_dirs, f"package folders the README's module map does not name: {missing_dirs}"

    def covered(mod: str) -> bool:
        stem = mod.rsplit("/", 1)[-1]
        if stem in ("__init__.py", "__main__.py"):
            return True
        for n in names:
            if n == stem or n == stem[:-3] or n.endswith("/" + stem):
                return True
            if "*" in n and re.fullmatch(n.replace(".", r"\.").replace("*", ".*"), stem):
                return True
        return False

    missing = sorted(_rel(p) for p in _modules() if not covered(_rel(p)))
    assert not missing, f"modules the README's module map does not name: {missing}"
