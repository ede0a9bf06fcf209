"""What the memory plan (plan.py) reads from a GGUF file, once: the weights per layer and at the
model's ends, and the sizes per slot (K/V, QSA block keys, recurrent state) and of the workspace,
for the whole model or a ``Part`` of it (a range of layers with the ends it holds: one stage of a
layer pipeline, mgserve/pipeline/stages.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import TYPE_CHECKING

from mgserve.core.gguf.hparams import ModelSpec, spec_from_gguf
from mgserve.core.gguf.hparams_hybrid import (
    HYBRID_ARCHS,
    HybridSpec,
    dense_moe,
    hybrid_spec_from_gguf,
)
from mgserve.core.gguf.hparams_qwen4exp import Qwen4ExpSpec, qwen4exp_spec_from_gguf
from mgserve.core.gguf.reader import GGUFFile, TensorInfo
from mgserve.cuda.graphs import BUCKETS
from mgserve.cuda.ops.attention_cuda import MAX_SPLITS
from mgserve.cuda.ops.deltanet_prefill_cuda import CHUNK as DELTA_CHUNK
from mgserve.cuda.ops.deltanet_prefill_cuda import CHUNK_FLOATS, PREFILL_PIECE
from mgserve.cuda.ops.hgemm import HGemmTuning
from mgserve.cuda.ops.linear_cuda import SCRATCH_BYTES
from mgserve.cuda.ops.qsa_prefill import QSA_SCORE_GROUP

if TYPE_CHECKING:
    from mgserve.cuda.plan_trace import LoadTrace

PLE_TABLE = "per_layer_token_embd.weight"  # qwen4exp: stays memory-mapped on the host
SAMPLER_ROW_PASSES = 8  # [B, V] float32-sized temporaries of the sampling chain at once (sort)


def kv_bytes(cache_type: str, n_values: int) -> int:
    """Bytes of ``n_values`` K or V values (whole q8_0 blocks: int8 plus one f16 scale per 32),
    as ``kv_storage`` allocates them."""
    if cache_type == "q8_0":
        return n_values + n_values // 32 * 2
    return n_values * (4 if cache_type == "f32" else 2)


def layer_of(t: TensorInfo) -> int | None:
    """The layer a tensor belongs to (``blk.N.``), None for the model's ends."""
    return int(t.name.split(".")[1]) if t.name.startswith("blk.") else None


def _is_vector(t: TensorInfo) -> bool:
    """Loaded by ``Loader.vec`` (float32 on the device): one dimension, norms, conv taps."""
    dims = [n for n in t.shape if n > 1]
    return len(dims) <= 1 or "norm" in t.name or t.name.endswith("conv1d.weight")


def device_bytes(t: TensorInfo) -> int:
    """Bytes a tensor takes on the device: its blocks, or float32 for a vector."""
    return 4 * t.n_elements if _is_vector(t) else t.n_bytes


@dataclass(frozen=True)
class Part:
    """Layers [start, stop) of a model, with the token embedding (``first``) and the output head,
    its norm and the sampler (``last``): one stage of a layer pipeline."""

    start: int
    stop: int
    first: bool = True
    last: bool = True

    @classmethod
    def whole(cls, n_layer: int) -> Part:
        return cls(0, n_layer)

    def __contains__(self, il: object) -> bool:
        return isinstance(il, int) and self.start <= il < self.stop


@dataclass(frozen=True)
class ModelSizes:
    """What the plan reads from the file, once; ``plan`` sizes it for settings. Per-slot sizes
    take a ``Part`` (None: the whole model)."""

    spec: ModelSpec
    hp: HybridSpec | None
    qp: Qwen4ExpSpec | None
    layer_weights: tuple[int, ...]  # per layer: file-layout matrices and float32 vectors
    tail: int  # weights of neither a layer, the head nor the embedding (output norm, HC head mix)
    head: int  # the output projection's blocks (the token embedding's when tied)
    embedding: int  # the float32 token table
    scratch: int  # f16 scratch of long prompts: W tiles of at most SCRATCH_BYTES
    ple_table: int  # host bytes of the PLE table (0: none)
    source: GGUFFile | None = field(default=None, compare=False, repr=False)  # for ``trace``
    traces: dict[Part, LoadTrace] = field(default_factory=dict, compare=False, repr=False)
    # the whole load's allocator replay, (blocks beyond the requests, requests), by pool sizes
    replays: dict[tuple[int, ...], tuple[int, int]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @classmethod
    def of(cls, g: GGUFFile) -> ModelSizes:
        hp = qp = None
        if g.architecture in HYBRID_ARCHS:
            spec, hp = hybrid_spec_from_gguf(g)
            if spec.arch == "qwen4exp":
                qp = qwen4exp_spec_from_gguf(g, hp.recurrent, spec.n_rot)
        else:
            spec = spec_from_gguf(g)
        layers, tail = [0] * spec.n_layer, 0
        head = scratch = ple = 0
        for t in g:
            if t.name == PLE_TABLE:
                ple = t.n_bytes
                continue
            il = layer_of(t)
            if il is not None and il >= spec.n_layer:
                continue  # appended MTP (nextn) layers: not loaded
            if t.name == ("token_embd.weight" if spec.tied_output else "output.weight"):
                head = t.n_bytes
            elif il is not None:
                layers[il] += device_bytes(t)
            elif t.name != "token_embd.weight":
                tail += device_bytes(t)
            if not _is_vector(t) and len(t.shape) == 2:  # the matrices prompts multiply
                k, rows = t.shape[0], prod(t.shape[1:])
                scratch = max(scratch, min(rows, max(1, SCRATCH_BYTES // (2 * k))) * k * 2)
        if qp is not None and hp is not None:  # qwen4exp's DeltaNet: out_heads, int32 [H_v]
            for il in hp.recurrent_layers:
                layers[il] += 4 * hp.ssm_v_heads
        table = 4 * spec.n_vocab * spec.n_embd
        return cls(spec, hp, qp, tuple(layers), tail, head, table, scratch, ple, source=g)

    def _part(self, part: Part | None) -> Part:
        return Part.whole(self.spec.n_layer) if part is None else part

    def trace(self, part: Part) -> LoadTrace | None:
        """The device storages of loading ``part`` on the CUDA path, pools left out (traced once
        per part on the meta device: plan_trace.py); None without the file."""
        if self.source is None:
            return None
        if part not in self.traces:
            from mgserve.cuda.plan_trace import load_trace

            whole = part == Part.whole(self.spec.n_layer)
            self.traces[part] = load_trace(self.source, None if whole else part)
        return self.traces[part]

    @property
    def weights(self) -> int:
        """Every weight but the head and the token embedding."""
        return sum(self.layer_weights) + self.tail

    def weights_of(self, part: Part) -> int:
        """A part's weights: its layers', and the embedding, head and tail at the ends."""
        w = sum(self.layer_weights[part.start : part.stop])
        return (
            w + (self.embedding if part.first else 0) + (self.tail + self.head if part.last else 0)
        )

    # -- per-slot sizes ---------------------------------------------------------------------------

    def attn_layers(self, part: Part | None = None) -> int:
        """Layers with a K/V cache (every layer but the recurrent ones)."""
        pt, rec = self._part(part), self.hp.recurrent if self.hp else ()
        return sum(1 for il in range(pt.start, pt.stop) if not (rec and rec[il]))

    def recurrent_layers(self, part: Part | None = None) -> int:
        pt = self._part(part)
        return sum(self.hp.recurrent[pt.start : pt.stop]) if self.hp else 0

    def qsa_layers(self, part: Part | None = None) -> int:
        pt = self._part(part)
        return sum(1 for il in self.qp.qsa_layers if il in pt) if self.qp else 0

    @property
    def rewindable(self) -> bool:
        return self.hp is None or not any(self.hp.recurrent)

    def kv(self, n_ctx: int, type_k: str, type_v: str, part: Part | None = None) -> int:
        """One slot's K and V, every attention layer (of ``part``)."""
        n = n_ctx * self.spec.kv_dim
        return self.attn_layers(part) * (kv_bytes(type_k, n) + kv_bytes(type_v, n))

    def blocks(self, n_ctx: int, part: Part | None = None) -> int:
        """One slot's QSA block keys (float32), every QSA layer (of ``part``)."""
        qp = self.qp
        if qp is None or not qp.qsa_layers:
            return 0
        return 4 * self.qsa_layers(part) * (n_ctx // qp.ratio) * qp.idx_dim

    def state(self, part: Part | None = None) -> int:
        """One slot's state that only goes forward (float32), in the layers of ``part``: DeltaNet
        conv and recurrent states, QSA pending keys, the PLE conv history. A checkpoint is this
        size."""
        hp, qp, pt, floats = self.hp, self.qp, self._part(part), 0
        if hp is not None:
            per_layer = max(hp.ssm_conv - 1, 0) * hp.conv_dim + hp.ssm_v_heads * hp.ssm_head_dim**2
            floats += self.recurrent_layers(pt) * per_layer
        if qp is not None:
            floats += self.qsa_layers(pt) * qp.ratio * qp.idx_dim
            if qp.ple is not None and qp.ple.layer in pt:
                floats += qp.ple.history * qp.hc * self.spec.n_embd
        return 4 * floats

    @property
    def recurrent(self) -> int:
        """The whole model's ``state``."""
        return self.state()

    # -- the workspace ----------------------------------------------------------------------------

    def _token_floats(self) -> int:
        """float32 values of activation per token of a step that may be live at once (an upper
        estimate: the streams, the wider of the two mixers and of the two FFNs, their outputs)."""
        s, hp, qp = self.spec, self.hp, self.qp
        d, hc = s.n_embd, qp.hc if qp else 1
        streams = 4 * hc * d + 4 * d
        q_out = 2 * s.q_dim if hp is not None and hp.attn_gated else s.q_dim
        attn = q_out + 2 * s.q_dim + 3 * s.kv_dim
        if qp is not None:
            attn += 2 * qp.idx_heads * qp.idx_dim + qp.idx_dim
        mixer, ffn = attn, 3 * s.n_ff
        if hp is not None and any(hp.recurrent):
            hv = hp.ssm_v_heads
            prep = hv * CHUNK_FLOATS // DELTA_CHUNK  # the chunked prefill's per-chunk solve
            mixer = max(attn, 2 * hp.conv_dim + 3 * hp.value_dim + 4 * hv + prep)
        experts = hp or dense_moe(s)
        if experts is not None:  # routed experts: kk rows per token (h in f16), the shared one
            kk, ff = experts.n_expert_used, experts.n_ff_exp
            ffn = experts.n_expert + 2 * kk + kk * (ff // 2 + d) + 2 * d + 3 * experts.n_ff_shexp
        widest = max(s.n_ff, hc * d, q_out, hp.value_dim if hp is not None else 0)
        # + an f16 copy of the widest GEMM input (the normed streams of a mix, hc * d wide),
        # and F16Rows' second entry (an fp32 input and its f16 copy held past the input's use:
        # f16_rows.py)
        return streams + mixer + ffn + widest + 3 * widest // 2

    def workspace(self, n_ctx: int, n_slots: int, batch: int, part: Part | None = None) -> int:
        """Bytes the steps allocate beyond weights and pools (estimate; the caching allocator
        keeps a step's peak): a prompt chunk of ``batch`` tokens, the decode graphs' pool for
        ``n_slots`` sessions, the sampler's [B, V] rows (the last part) and the f16 weight
        scratch; each part (a pipeline stage) has its own."""
        s, qp, pt = self.spec, self.qp, self._part(part)
        per_token = 4 * self._token_floats()
        b = next((x for x in BUCKETS if x >= n_slots), BUCKETS[-1])
        v = s.n_vocab if pt.last else 0  # logits rows
        prompt = batch * per_token + 4 * min(batch, n_slots) * v
        if self.recurrent_layers(pt):  # DeltaNet prefill pieces
            prompt += 4 * min(batch, PREFILL_PIECE) * self.hp.conv_dim  # type: ignore[union-attr]
        decode = b * (per_token + 4 * v)
        if self.attn_layers(pt):
            decode += 4 * b * s.n_head * MAX_SPLITS * (s.head_dim + 2)
        if qp is not None and self.qsa_layers(pt):  # QSA block scores, the prompt's visibility
            cols = -(-(n_ctx // qp.ratio) // 4) * 4
            # a padded score group's products (the last one still held while the next is made)
            # and scores: QSA_SCORE_GROUP x (2 heads + 1) rows, where 2 x batch does not cover it
            group = max(2 * batch, QSA_SCORE_GROUP * (2 * qp.idx_heads + 1))
            prompt += 4 * group * cols + 4 * batch * (n_ctx // 32)
            decode += 8 * b * cols
        sampler = SAMPLER_ROW_PASSES * 4 * b * (v + 1) if pt.last else 0
        scratch = self.scratch if batch >= HGemmTuning().min_rows else 0
        return prompt + decode + sampler + scratch
