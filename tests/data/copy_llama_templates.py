"""Copy llama.cpp's real chat templates into tests/data/templates/ (run once; copies are committed).

llama.cpp keeps the chat templates of ~70 model families, as their authors published them, in
``models/templates/*.jinja``; tests/core/test_chat_templates.py renders every one. They are test
data under llama.cpp's MIT licence, which is copied beside them (LICENSE.llama.cpp) with the
upstream README that says where each file came from.

    python tests/data/copy_llama_templates.py [path/to/llama.cpp]

The default source is the llama.cpp vendored by llama-cpp-python 0.3.36's sdist, unpacked in /tmp.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

HERE = Path(__file__).parent
DEFAULT_SRC = Path("/tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp")
NOTE = """\
Chat templates copied from llama.cpp (models/templates/, as vendored by llama-cpp-python 0.3.36)
by tests/data/copy_llama_templates.py. They are the model authors' own templates, kept by llama.cpp
as test data; llama.cpp is MIT-licensed (LICENSE.llama.cpp), README.llama.cpp is its note on where
each file comes from. mgserve uses them only in tests (tests/core/test_chat_templates.py).
"""


def main(src: Path) -> None:
    templates = src / "models" / "templates"
    files = sorted(templates.glob("*.jinja"))
    if not files:
        raise SystemExit(f"no *.jinja under {templates}")
    out = HERE / "templates"
    out.mkdir(exist_ok=True)
    for old in out.glob("*.jinja"):
        old.unlink()
    for f in files:
        shutil.copyfile(f, out / f.name)
    shutil.copyfile(templates / "README.md", out / "README.llama.cpp")
    shutil.copyfile(src / "LICENSE", out / "LICENSE.llama.cpp")
    (out / "README.md").write_text(NOTE)
    print(f"copied {len(files)} templates to {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_SRC)
