"""Grammar masks in the device sampler (mgserve/cuda/sampling/) and the device runner.

CPU tests (run in CI): constrained rows draw only allowed tokens and match the CPU sampler
greedily; unconstrained rows beside them come out bit for bit as without any grammar in the batch
(batch invariance); a preallocated batch with room for masks matches a built one; the device
runner under a grammar gives the reference runner's tokens and fills a step's masks after it
launches the step's forward (the overlap). A forced token (a reasoning budget closing its block)
is a mask of that one token: drawn whatever the row's settings, and the device runner forces
reasoning closes as the reference does. GPU tests (marked): the same on the device at a 248k
vocabulary, and a CUDA-graph capture that replays with new masks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest
import torch

from mgserve.config import Settings
from mgserve.core.engine.actor import Engine
from mgserve.core.engine.contract import Request, SamplingParams
from mgserve.core.engine.reasoning import ReasoningBudget
from mgserve.core.engine.sampling import SeqSampler
from mgserve.core.gguf.reader import GGUFFile
from mgserve.core.grammar import ForcedToken, Grammar, GrammarCompiler, GrammarSpec, Matcher
from mgserve.core.models import load_model
from mgserve.core.text.special import ATTR_CONTROL, ATTR_NORMAL, ATTR_UNUSED
from mgserve.cuda.sampling import DeviceSampler, SamplingBatch, SamplingPlan, SamplingRow, seeded
from mgserve.cuda.sampling.chain import modified_logits

CPU = torch.device("cpu")
SAMPLER = DeviceSampler()
TINY_VOCAB = 160  # tests/core/tiny.py's models
EOS = TINY_VOCAB - 1


class AsciiTokenizer:
    """Ids 0..127 are their ASCII byte, the rest unused but the last, a control <eos>."""

    n_vocab = TINY_VOCAB
    bos_id = None
    eog_ids = frozenset({EOS})

    def piece(self, token: int, special: bool = True) -> bytes:
        return bytes([token]) if token < 128 else b"<eos>" if token == EOS else b""

    def attr(self, token: int) -> int:
        return ATTR_NORMAL if token < 128 else ATTR_CONTROL if token == EOS else ATTR_UNUSED

    def token_text(self, token: int) -> str:
        return self.piece(token).decode()

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        return list(text.encode("ascii"))


@cache
def ascii_grammar(gbnf: str) -> Grammar:
    return GrammarCompiler(AsciiTokenizer(), TINY_VOCAB).compile(  # type: ignore[arg-type]
        GrammarSpec("gbnf", gbnf)
    )


WORDS = 'root ::= "cab" | "bad" | "ace" | [0-9] [0-9] [0-9]'


def rows_and_matchers(grammar_rows: set[int]) -> tuple[list[SamplingRow], list[Matcher | None]]:
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(seed=1, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
        SamplingParams(seed=2, top_k=5, top_p=0.9, repeat_penalty=1.2),
        SamplingParams(seed=3, temperature=1.5, top_k=0, top_p=0.8, logit_bias=((ord("c"), 2.0),)),
    ]
    matchers = [ascii_grammar(WORDS).matcher() if i in grammar_rows else None for i in range(4)]
    rows = [
        SamplingRow(seeded(p), [ord("a"), ord("b")], 0, matcher=m)
        for p, m in zip(params, matchers, strict=True)
    ]
    return rows, matchers


def logits(b: int, v: int, seed: int) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3  # [B, V]


def test_constrained_rows_draw_allowed_tokens_and_others_are_untouched() -> None:
    x = logits(4, TINY_VOCAB, 0)
    free_rows, _ = rows_and_matchers(set())
    free = SamplingBatch.build(free_rows, TINY_VOCAB, CPU)
    for step in range(3):  # every step a new draw (counter) and a new mask (matcher advanced)
        rows, matchers = rows_and_matchers({0, 3})
        for m in matchers:
            if m is not None:
                for t in b"ba"[:step]:
                    m.advance(t)
        allowed = [m.allowed().tolist() if m is not None else [] for m in matchers]
        batch = SamplingBatch.build(rows, TINY_VOCAB, CPU)
        assert batch.plan.mask and batch.allowed.shape == (4, 5)
        out = SAMPLER.sample(x, batch).tokens.tolist()
        for i in (0, 3):
            assert out[i] in allowed[i], (step, i, out[i])
        want = SAMPLER.sample(x, free).tokens.tolist()
        assert [out[1], out[2]] == [want[1], want[2]]
        mod, mod_free = modified_logits(x, batch, batch.plan), modified_logits(x, free, free.plan)
        assert torch.equal(mod[1:3], mod_free[1:3])  # an all-ones mask is an exact identity
        # greedy under a grammar: the CPU sampler's token
        cpu = SeqSampler(SamplingParams(temperature=0.0), grammar=ascii_grammar(WORDS))
        assert cpu.matcher is not None
        for t in b"ba"[:step]:
            cpu.matcher.advance(t)
        assert out[0] == cpu.sample(x[0])


def test_forced_rows_draw_their_token_and_others_are_untouched() -> None:
    x = logits(4, TINY_VOCAB, 3)
    free_rows, _ = rows_and_matchers(set())
    want = SAMPLER.sample(x, SamplingBatch.build(free_rows, TINY_VOCAB, CPU)).tokens.tolist()
    for forced in ((1, 95), (3, 31), (0, 159)):  # bit 31 of its word: the sign bit
        row, tok = forced
        rows = list(free_rows)
        rows[row] = rows[row]._replace(matcher=ForcedToken(tok, TINY_VOCAB))
        if row == 3:  # a bias that bans the forced token loses to the mask, as to a grammar
            p = rows[3].params
            rows[3] = rows[3]._replace(params=seeded(replace(p, logit_bias=((tok, -torch.inf),))))
        out = SAMPLER.sample(x, SamplingBatch.build(rows, TINY_VOCAB, CPU)).tokens.tolist()
        assert out[row] == tok
        assert [t for i, t in enumerate(out) if i != row] == [
            t for i, t in enumerate(want) if i != row
        ]
        cpu = SeqSampler(rows[row].params)
        assert cpu.sample(x[row], force=tok) == tok


def test_preallocated_batch_with_masks_matches_built_batch() -> None:
    x = logits(6, TINY_VOCAB, 1)
    fixed = SamplingBatch.allocate(6, TINY_VOCAB, CPU, max_window=4, max_bias=2, grammar=True)
    for grammar_rows in ({0, 3}, set(), {1}):
        built_rows, _ = rows_and_matchers(grammar_rows)
        fixed_rows, _ = rows_and_matchers(grammar_rows)
        want = SAMPLER.sample(x[:4], SamplingBatch.build(built_rows, TINY_VOCAB, CPU)).tokens
        got = SAMPLER.sample(x, fixed.update(fixed_rows)).tokens
        broad = SAMPLER.sample(x, fixed, SamplingPlan.broad()).tokens
        assert torch.equal(got[:4], want) and torch.equal(broad[:4], want)
    no_room = SamplingBatch.allocate(4, TINY_VOCAB, CPU)
    with pytest.raises(ValueError, match="no room for masks"):
        no_room.update(rows_and_matchers({2})[0])


async def _serve(engine: Engine, reqs: list[Request]) -> dict[str, list[int]]:
    await engine.start()
    try:

        async def one(r: Request) -> tuple[str, list[int]]:
            return r.id, [ev.token async for ev in engine.submit(r) if ev.token is not None]

        return dict(await asyncio.gather(*(one(r) for r in reqs)))
    finally:
        await engine.stop()


def _requests() -> list[Request]:
    g = ascii_grammar(WORDS)
    greedy = SamplingParams(temperature=0.0)
    stop = frozenset({EOS})
    return [
        Request("a", list(range(20, 50)), greedy, 8, stop, grammar=g),
        Request("b", list(range(30, 45)), greedy, 8, stop),
        Request("c", list(range(60, 70)), greedy, 8, stop, grammar=g),
    ]


async def _reference_and_device(
    tmp_path: Path, requests: Callable[[], list[Request]]
) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """The tokens of ``requests()`` on the tiny qwen3: the reference engine's, the device
    runner's (torch backend, on the CPU)."""
    from mgserve.cuda.backend import load_device_model, torch_backend
    from mgserve.cuda.runner import DeviceRunner
    from tests.cuda.test_device_models import _export

    settings = Settings(parallel=3, ctx_size=96, batch_size=16)
    path = _export("qwen3", tmp_path)
    ref = await _serve(Engine(load_model(path, threads=1), settings), requests())
    model = load_device_model(
        GGUFFile(path), torch_backend(), CPU, settings.parallel, settings.ctx_size
    )
    runner = DeviceRunner(model, CPU, graphs=False)
    return ref, await _serve(Engine(model, settings, runner=runner), requests())


async def test_device_runner_under_a_grammar_serves_like_the_reference(tmp_path: Path) -> None:
    ref, got = await _reference_and_device(tmp_path, _requests)
    assert got == ref
    for rid in ("a", "c"):  # a word of the grammar, then the end of generation
        assert (
            ref[rid][-1] == EOS
            and bytes(ref[rid][:-1]).decode() in ("cab", "bad", "ace")
            or (bytes(ref[rid][:-1]).isdigit() and len(ref[rid]) == 4)
        ), ref[rid]


def _budgeted() -> list[Request]:
    g = ascii_grammar(WORDS)
    greedy, stop = SamplingParams(temperature=0.0), frozenset({EOS})
    close, forced = tuple(b"</>"), tuple(b"</>\n\n")
    think = [ReasoningBudget(k, tuple(b"<>"), close, forced, True) for k in (2, 0)]
    return [
        Request("a", list(range(20, 50)), greedy, 14, stop, grammar=g, reasoning=think[0]),
        Request("b", list(range(30, 45)), greedy, 8, stop),
        Request("c", list(range(60, 70)), SamplingParams(seed=5), 9, stop, reasoning=think[1]),
    ]


async def test_device_runner_forces_reasoning_closes_like_the_reference(tmp_path: Path) -> None:
    ref, got = await _reference_and_device(tmp_path, _budgeted)
    assert bytes(got["a"][2:7]) == b"</>\n\n" and bytes(got["c"][:5]) == b"</>\n\n"
    word = bytes(got["a"][7:-1])  # then the grammar's answer
    assert got["a"][-1] == EOS and (word in (b"cab", b"bad", b"ace") or word.isdigit()), word
    assert got["a"] == ref["a"] and got["b"] == ref["b"]  # greedy: the reference's tokens
    assert len(got["c"]) == len(ref["c"])  # sampled: each path's own noise after the close


def test_the_runner_fills_a_steps_masks_after_launching_its_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The masks of a step are computed on the host after its forward is launched, so on a GPU
    they overlap it (``mgserve bench structured`` measures what is left)."""
    from mgserve.core.engine.contract import ScheduledBatch, SeqWork
    from mgserve.core.text.tokenizer import Tokenizer
    from mgserve.cuda.backend import load_device_model, torch_backend
    from mgserve.cuda.runner import DeviceRunner

    g = GGUFFile(Path(__file__).resolve().parent.parent / "data" / "converted_llama.gguf")
    model = load_device_model(g, torch_backend(), CPU, 1, 64)
    runner = DeviceRunner(model, CPU, graphs=False)
    calls: list[str] = []
    forward, fill = runner.decode, Matcher.fill
    monkeypatch.setattr(runner, "decode", lambda inp: (calls.append("forward"), forward(inp))[1])
    monkeypatch.setattr(Matcher, "fill", lambda m, row: (calls.append("mask"), fill(m, row))[1])
    compiler = GrammarCompiler(Tokenizer.from_metadata(g.metadata), model.spec.n_vocab)
    grammar = compiler.compile(GrammarSpec("gbnf", WORDS))
    greedy = SamplingParams(temperature=0.0)
    first = SeqWork(0, "a", (1, 40, 41), 0, True, greedy, new_sequence=True, grammar=grammar)
    token = runner.run(ScheduledBatch(1, (first,))).results[0].token
    calls.clear()
    runner.run(ScheduledBatch(2, (SeqWork(0, "a", (token,), 3, True, greedy),)))
    assert calls == ["forward", "mask"]


# --------------------------------------------------------------------------------------------
# GPU


@cache
def qwen35_compiler() -> GrammarCompiler:
    from mgserve.core.synth.shapes import QWEN4EXP_FLASH_NEXT
    from mgserve.core.text.tokenizer import Tokenizer

    meta = {k: v for k, (v, _) in QWEN4EXP_FLASH_NEXT.vocab.metadata().items()}
    tok = Tokenizer.from_metadata(meta)
    return GrammarCompiler(tok, tok.n_vocab)


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer"}},
    "required": ["answer", "n"],
}


def gpu_rows(step: int, matchers: list[Matcher | None]) -> list[SamplingRow]:
    ps = [SamplingParams(seed=i, temperature=0.0 if i % 3 == 0 else 1.0) for i in range(8)]
    return [
        SamplingRow(seeded(p), [5, 6], step, matcher=m) for p, m in zip(ps, matchers, strict=True)
    ]


@pytest.mark.gpu
def test_gpu_masks_match_cpu_and_replay_in_a_graph() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    dev = torch.device("cuda")
    c = qwen35_compiler()
    v = c.n_vocab
    g = c.json_schema(SCHEMA)
    x = logits(8, v, 2)
    cpu_m = [g.matcher() if i % 2 == 0 else None for i in range(8)]
    gpu_m = [g.matcher() if i % 2 == 0 else None for i in range(8)]
    want = SAMPLER.sample(x, SamplingBatch.build(gpu_rows(0, cpu_m), v, CPU)).tokens
    got = SAMPLER.sample(x.to(dev), SamplingBatch.build(gpu_rows(0, gpu_m), v, dev)).tokens
    assert got.tolist() == want.tolist()

    xd = x.to(dev)
    fixed = SamplingBatch.allocate(8, v, dev, max_window=4, max_bias=0, grammar=True)
    matchers = [g.matcher() if i % 2 == 0 else None for i in range(8)]
    fixed.update(gpu_rows(0, matchers))
    plan = SamplingPlan.broad()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        SAMPLER.sample(xd, fixed, plan)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = SAMPLER.sample(xd, fixed, plan)
    for step in range(6):  # each replay: new masks, tokens allowed, equal to eager
        allowed = [m.allowed().tolist() if m is not None else [] for m in matchers]
        fixed.update(gpu_rows(step, matchers))
        graph.replay()
        tokens = out.tokens.tolist()
        assert tokens == SAMPLER.sample(xd, fixed, plan).tokens.tolist()
        for i, m in enumerate(matchers):
            if m is not None:
                assert tokens[i] in allowed[i]
                m.advance(tokens[i])
    # timing (informational): the sampler with and without masks at V = 248320, B = 8
    free = SamplingBatch.allocate(8, v, dev, max_window=4, max_bias=0)
    free.update(gpu_rows(0, [None] * 8))
    for name, batch in (("with masks", fixed), ("without", free)):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(20):
            SAMPLER.sample(xd, batch, plan)
        t1.record()
        t1.synchronize()
        print(f"device sampler {name}: {t0.elapsed_time(t1) / 20 * 1e3:.0f} us per step")


@pytest.mark.gpu
def test_gpu_forced_rows_at_a_full_vocabulary() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    dev, v = torch.device("cuda"), 248320
    x = logits(8, v, 4).to(dev)
    forced = {0: v - 1, 2: 31, 4: 151668, 6: 63}  # 31, 63: the sign bit of their words
    ps = [SamplingParams(seed=i, temperature=0.0 if i % 4 == 0 else 1.0) for i in range(8)]
    free = [SamplingRow(seeded(p), [5, 6], 3) for p in ps]
    rows = list(free)
    for i, t in forced.items():
        rows[i] = rows[i]._replace(matcher=ForcedToken(t, v))
    want = SAMPLER.sample(x, SamplingBatch.build(free, v, dev)).tokens.tolist()
    got = SAMPLER.sample(x, SamplingBatch.build(rows, v, dev)).tokens.tolist()
    assert [got[i] for i in forced] == list(forced.values())
    assert [got[i] for i in range(8) if i not in forced] == [
        want[i] for i in range(8) if i not in forced
    ]
