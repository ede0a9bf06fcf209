"""Two sessions decoding while a third's long prompt is chunked beside them, for the engine tests
of every runner (the prefill pacer's, the prefill lane's): greedy with logprobs, so that outputs
compare to the bit.

The prefill lane's load (``LANE_*``): five chunks of 64, then the last prompt token alone (which a
device runner computes on the decode kernels); checkpoints every 128 tokens, one per slot in
device memory, so that on recurrent models the book moves one to host memory."""

from __future__ import annotations

from mgserve.config import Settings
from mgserve.core.engine.actor import Engine
from mgserve.core.engine.contract import Request, SamplingParams, ScheduledBatch, StepResult

GREEDY = SamplingParams(temperature=0.0, want_logprob=True)
LANE_SETTINGS = Settings(
    parallel=3, ctx_size=512, batch_size=64, checkpoint_every=128, ctx_checkpoints=1
)
LANE_PROMPT = 321
LANE_DECODE = 80  # the decoders' tokens: they outlast the prompt
LANE_CHUNKS = [64] * 5 + [1]

Out = dict[str, list[tuple[int | None, float | None]]]


async def serve(engine: Engine, n_prompt: int, n_decode: int) -> tuple[Out, list[int]]:
    """The load on a fresh engine (started and stopped here): every request's (token, logprob)s
    (an error is (None, None)) and the lengths of the long prompt's chunks."""
    runner: object = engine._runner
    chunks: list[int] = []
    run = runner.run  # type: ignore[attr-defined]

    def spy(batch: ScheduledBatch) -> StepResult:  # p's prompt chunks
        chunks.extend(
            len(w.tokens) for w in batch.work if w.request_id == "p" and w.start < n_prompt
        )
        return run(batch)

    runner.run = spy  # type: ignore[attr-defined]
    await engine.start()
    try:
        decoders = {
            f"d{i}": engine.submit(Request(f"d{i}", [7 + i, 40, 41], GREEDY, max_tokens=n_decode))
            for i in range(2)
        }
        firsts = {rid: await anext(s) for rid, s in decoders.items()}  # both decode now
        out: Out = {rid: [(ev.token, ev.logprob)] for rid, ev in firsts.items()}
        prompt = [(13 * i) % 300 + 10 for i in range(n_prompt)]
        streams = {**decoders, "p": engine.submit(Request("p", prompt, GREEDY, max_tokens=4))}
        for rid, s in streams.items():
            out.setdefault(rid, []).extend([(ev.token, ev.logprob) async for ev in s])
    finally:
        await engine.stop()
        runner.run = run  # type: ignore[attr-defined]
    return out, chunks
