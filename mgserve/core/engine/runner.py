"""The reference runner: executes a ``ScheduledBatch`` on a ``CausalLM`` and samples, on the CPU.

The twin of ``mgserve/cuda/runner.py``: same contract, plain PyTorch. It owns one KV cache per slot
(created on first use) and one ``SeqSampler`` per running session. It is synchronous; the engine
calls ``run`` in a worker thread so the event loop stays free while the model computes.

A freed slot keeps its cache: the scheduler remembers which tokens it holds, and a later request
with the same prefix starts past them. A cache is positional (writing at ``start`` overwrites
whatever was at ``start`` and later), which is what makes that reuse safe without clearing it.
A recurrent model's checkpoints (checkpoints.py) are ``HybridState`` snapshots in CPU memory; the
book's device and host tiers are both host memory here, so a move to the host keeps it as it is.
A slot save copies the slot's K/V rows (and qwen4exp's QSA block keys) and, for a recurrent model,
its live state and checkpoints as snapshots, named by field (slot_state.py). A prefix copy copies
the first rows of one slot into another, and a recurrent source's checkpoint (or live state) into
the target's state, before anything else in its step. A session's verify entry (``n_draft``
drafts) gets logits at all its positions; verify.py samples them and rolls a recurrent state back.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from mgserve.core.engine import slot_state, verify
from mgserve.core.engine.checkpoints import CheckpointStore
from mgserve.core.engine.contract import (
    PrefixCopy,
    SamplingParams,
    ScheduledBatch,
    SeqResult,
    SlotLoad,
    SlotSave,
    SlotTensors,
    StepResult,
)
from mgserve.core.engine.sampling import SeqSampler, logprobs_for
from mgserve.core.engine.slot_state import Part, check, ckpt_name, copy_in, copy_out, layout
from mgserve.core.grammar import failures
from mgserve.core.models.base import CausalLM, SeqInput
from mgserve.core.models.kvcache import KVCache
from mgserve.core.models.state import HybridState, Snapshot
from mgserve.core.models.state_qwen4exp import Qwen4ExpState


class ReferenceRunner:
    supports_drafts = True  # verifies SeqWork.n_draft drafts (verify.py)

    # n_ctx and the cache types are the slot caches' own (CausalLM.new_cache), passed through
    def __init__(
        self,
        model: CausalLM,
        n_slots: int,
        n_ctx: int,
        type_k: str = "f16",
        type_v: str = "f16",
    ) -> None:
        self.model = model
        self.n_ctx = n_ctx
        self.type_k, self.type_v = type_k, type_v
        self._caches: list[KVCache | None] = [None] * n_slots  # KVCache per slot, made lazily
        self._samplers: dict[int, SeqSampler] = {}  # slot -> the running session's sampler
        self.checkpoints: CheckpointStore[Snapshot] = CheckpointStore(
            lambda slot: self._state(slot).snapshot(),
            lambda slot, snap: self._state(slot).restore(snap),
            lambda snap: snap,
        )

    def _cache(self, slot: int) -> KVCache:
        cache = self._caches[slot]
        if cache is None:
            cache = self.model.new_cache(self.n_ctx, self.type_k, self.type_v)
            self._caches[slot] = cache
        return cache

    def _state(self, slot: int) -> HybridState:
        state = self._cache(slot)
        if not isinstance(state, HybridState):
            raise ValueError("checkpoints are for recurrent models (a HybridState per slot)")
        return state

    @property
    def checkpoint_nbytes(self) -> int:
        """Bytes of one checkpoint (0: the model's state is a plain KV cache, which rewinds)."""
        state = self._cache(0)
        return state.recurrent_nbytes if isinstance(state, HybridState) else 0

    slot_format = "reference"  # how a saved slot's tensors are laid out (slot files check it)

    def run(self, batch: ScheduledBatch) -> StepResult:
        t0 = time.perf_counter()
        for slot in batch.freed_slots:
            self._samplers.pop(slot, None)
        for copy in batch.prefix_copies:
            self._copy(copy)
        self.checkpoints.before(batch)
        if batch.slot_ops:
            saved = {op.id: self._save(op) for op in batch.slot_ops if isinstance(op, SlotSave)}
            for op in batch.slot_ops:
                if isinstance(op, SlotLoad):
                    self._load(op)
            return StepResult(batch.step, seconds=time.perf_counter() - t0, saved=saved)
        seqs: list[SeqInput] = []
        kept: dict[int, verify.Kept] = {}  # slot -> its recurrent state before a verify forward
        for w in batch.work:
            if w.new_sequence:
                self._samplers[w.slot] = SeqSampler(w.sampling, w.history)
            if w.grammar is not None:
                self._samplers[w.slot].start_grammar(w.grammar)
            verify.check(w, self._samplers[w.slot])
            cache = self._cache(w.slot)
            if (k := verify.keep(cache, w)) is not None:
                kept[w.slot] = k
            seqs.append(
                SeqInput(
                    cache=cache,
                    tokens=torch.tensor(w.tokens, dtype=torch.int64),  # [T]
                    start=w.start,
                    n_logits=1 + w.n_draft if w.sample else 0,
                )
            )
        logits = self.model.forward(seqs)  # [rows, V] float32: 1 + n_draft per sampling work
        self.checkpoints.after(batch)

        sampled = [w for w in batch.work if w.sample]
        assert logits.shape[0] == sum(1 + w.n_draft for w in sampled), logits.shape
        results: list[SeqResult] = []
        rows: list[int] = []  # the logits row of each result
        params: list[SamplingParams] = []
        back: list[tuple[verify.Kept, tuple[int, ...]]] = []  # states to roll back
        r = 0  # the work's first logits row
        for w in batch.work:
            sampler = self._samplers[w.slot]
            if not w.sample:
                sampler.accept(w.tokens)  # in the context now: the penalty window sees them
                continue
            if w.n_draft:
                got = verify.sample_drafted(sampler, logits[r : r + 1 + w.n_draft], w.tokens)
                if len(got) < len(w.tokens) and w.slot in kept:
                    back.append((kept[w.slot], w.tokens[: len(got)]))
            else:
                sampler.accept(w.tokens)
                got = [sampler.sample(logits[r], w.force)]
            rows += range(r, r + len(got))
            params += [w.sampling] * len(got)
            results += [SeqResult(w.slot, w.request_id, tok, None, ()) for tok in got]
            r += 1 + w.n_draft
        verify.roll_back(self.model, back)
        extras = logprobs_for(logits[rows], [x.token for x in results], params)
        results = [x._replace(logprob=e[0], top=e[1]) for x, e in zip(results, extras, strict=True)]
        n_tokens = sum(len(w.tokens) for w in batch.work)
        failed = failures((w.request_id, self._samplers[w.slot].matcher) for w in sampled)
        return StepResult(batch.step, results, n_tokens, time.perf_counter() - t0, failed=failed)

    # -- prefix copy, slot save / restore --------------------------------------------------------

    def _copy(self, op: PrefixCopy) -> None:
        slot_state.copy_rows(self._parts(op.src), self._parts(op.dst), op.n)
        state = self._cache(op.dst)
        if isinstance(state, HybridState):
            src = self._state(op.src)
            if op.live and src.pos != op.n:
                raise RuntimeError(f"slot {op.src}'s state is at {src.pos}, not {op.n}")
            state.restore(src.snapshot() if op.live else self.checkpoints.get(op.src, op.n))

    def _parts(self, slot: int) -> dict[str, Part]:
        """The slot's positional tensors, one per layer: K/V (scales too), QSA block keys."""
        state = self._cache(slot)
        kv = state.kv if isinstance(state, HybridState) else state
        parts: dict[str, Part] = {}
        for side, store in (("k", kv.k), ("v", kv.v)):
            for il in range(store.values.shape[0]):
                parts[f"{side}.{il}"] = Part(store.values[il])
                if store.scales.numel():
                    parts[f"{side}.{il}.scales"] = Part(store.scales[il])
        if isinstance(state, Qwen4ExpState):
            ratio = state.pending.shape[1]  # a block key per `ratio` positions
            parts |= {f"blocks.{i}": Part(b, ratio) for i, b in enumerate(state.blocks)}
        return parts

    def _save(self, op: SlotSave) -> SlotTensors:
        state = self._cache(op.slot)
        out = copy_out(self._parts(op.slot), len(op.tokens))
        if isinstance(state, HybridState):
            out |= _flat("state", state.snapshot())
            for pos, snap in self.checkpoints.of_slot(op.slot, op.checkpoints).items():
                out |= _flat(ckpt_name(pos, "snap"), snap)
        return out

    def _load(self, op: SlotLoad) -> None:
        state, n = self._cache(op.slot), len(op.tokens)
        parts = self._parts(op.slot)
        want = layout(parts, n)
        template = state.snapshot() if isinstance(state, HybridState) else None
        names = ["state", *(ckpt_name(p, "snap") for p in op.checkpoints)]
        if template is not None:
            for name in names:
                want |= {k: (t.dtype, tuple(t.shape)) for k, t in _flat(name, template).items()}
        given = {k: t for k, t in op.tensors.items() if not k.startswith("ckpt.") or k in want}
        check(given, want)
        copy_in(parts, n, given)
        if isinstance(state, HybridState):
            assert template is not None
            state.restore(_rebuild("state", template, given, n))
            ckpts = {p: _rebuild(ckpt_name(p, "snap"), template, given, p) for p in op.checkpoints}
            self.checkpoints.replace(op.slot, ckpts)


def _flat(prefix: str, snap: tuple[Any, ...]) -> dict[str, torch.Tensor]:
    """A snapshot's tensors named ``prefix.field`` (nested snapshots: ``prefix.field.field``)."""
    out: dict[str, torch.Tensor] = {}
    for name, v in zip(snap._fields, snap, strict=True):  # type: ignore[attr-defined]
        if isinstance(v, torch.Tensor):
            out[f"{prefix}.{name}"] = v
        elif isinstance(v, tuple):
            out |= _flat(f"{prefix}.{name}", v)
    return out


def _rebuild(prefix: str, template: Any, tensors: SlotTensors, pos: int) -> Any:
    """The snapshot ``_flat(prefix, ...)`` gave ``tensors`` of, at position ``pos``."""
    fields: list[Any] = []
    for name, v in zip(template._fields, template, strict=True):
        key = f"{prefix}.{name}"
        if isinstance(v, torch.Tensor):
            fields.append(tensors[key].clone())
        elif isinstance(v, tuple):
            fields.append(_rebuild(key, v, tensors, pos))
        else:  # the position it was taken at
            fields.append(pos)
    return type(template)(*fields)
