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


def _map_words() -> set[str]:
    """The names the README's module map mentions (file names, folder names, ``prefix*``)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("## Module map", 1)[1].split("```", 2)[1]
    return set(re.findall(r"[\w.*]+/?", block))


def test_the_readme_module_map_names_every_module_and_folder() -> None:
    words = _map_words()
    patterns = [re.compile(w.replace(".", r"\.").replace("*", r"\w*")) for w in words if "*" in w]

    def named(stem: str) -> bool:
        return (
            stem in words
            or f"{stem}.py" in words
            or f"{stem}/" in words
            or any(pat.fullmatch(stem) or pat.fullmatch(f"{stem}.py") for pat in patterns)
        )

    missing = [
        _rel(p) for p in _modules() if p.stem not in ("__init__", "__main__") and not named(p.stem)
    ]
    missing += [
        _rel(d) + "/"
        for d in PKG.rglob("*")
        if d.is_dir() and d.name != "__pycache__" and not named(d.name)
    ]
    assert not missing, f"the README's module map does not name: {sorted(missing)}"


def test_every_file_the_readme_module_map_names_exists() -> None:
    files = {p.name for p in ROOT.rglob("*") if ".git" not in p.parts}
    block = (ROOT / "README.md").read_text(encoding="utf-8").split("## Module map", 1)[1]
    folders = re.findall(r"^\s*((?:[\w.]+/)+)", block.split("```", 2)[1], re.M)
    named = [w for w in _map_words() if w.endswith((".py", ".cu", ".cuh", ".md"))]
    named += [f.rstrip("/") for f in folders]
    gone = sorted(w for w in named if "*" not in w and w.rsplit("/", 1)[-1] not in files)
    assert not gone, f"the README's module map names what the tree does not have: {gone}"
