"""The memory plan: what serving a GGUF file on one GPU allocates, item by item, from the file's
metadata and tensor table and the serve settings, before anything is allocated (plan_fit.py
checks it against the device and says what to lower; ``mgserve info --plan`` prints it).

Every item is the size of what the GPU path really allocates (tests/cuda/test_plan.py compares
them with the tensors of loaded device models):

- weights (``Loader``): matrices in their GGUF blocks, vectors (norms, biases, conv taps) as
  float32; the output head (the token embedding's blocks when the model ties them); the token
  embedding as a float32 table [V, d] (``load_embeddings``: decode gathers rows on the device);
- per-slot state (``SlotPools``, ``--parallel`` slots plus the spare that pads decode graphs):
  K/V in the cache types, DeltaNet conv and recurrent states, QSA pending and block keys, the
  PLE conv history; a checkpoint is one slot's recurrent part (``snapshots.py``), at most
  ``--ctx-checkpoints`` per slot in device memory and ``--cache-ram`` MiB of them in pinned host
  memory (core/engine/checkpoints.py);
- the workspace: an estimate of the activations of a ``--batch-size`` prompt chunk, the decode
  graphs' pool, the sampler's rows and the f16 weight scratch of long prompts (``LinearCuda``);
- host memory besides: the PLE table (qwen4exp), memory-mapped and read row by row.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import NamedTuple

from mgserve.config import Settings
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
from mgserve.cuda.ops.attention_prefill import VIS_ELEMS
from mgserve.cuda.ops.deltanet_prefill_cuda import CHUNK as DELTA_CHUNK
from mgserve.cuda.ops.deltanet_prefill_cuda import CHUNK_FLOATS, PREFILL_PIECE
from mgserve.cuda.ops.hgemm import HGemmTuning
from mgserve.cuda.ops.linear_cuda import SCRATCH_BYTES

PLE_TABLE = "per_layer_token_embd.weight"  # qwen4exp: stays memory-mapped on the host
SAMPLER_ROW_PASSES = 8  # [B, V] float32-sized temporaries of the sampling chain at once (sort)


def kv_bytes(cache_type: str, n_values: int) -> int:
    """Bytes of ``n_values`` K or V values (whole q8_0 blocks: int8 plus one f16 scale per 32),
    as ``kv_storage`` allocates them."""
    if cache_type == "q8_0":
        return n_values + n_values // 32 * 2
    return n_values * (4 if cache_type == "f32" else 2)


def _is_vector(t: TensorInfo) -> bool:
    """Loaded by ``Loader.vec`` (float32 on the device): one dimension, norms, conv taps."""
    dims = [n for n in t.shape if n > 1]
    return len(dims) <= 1 or "norm" in t.name or t.name.endswith("conv1d.weight")


def _device_bytes(t: TensorInfo) -> int:
    return 4 * t.n_elements if _is_vector(t) else t.n_bytes


class Item(NamedTuple):
    name: str
    nbytes: int
    detail: str
    host: bool = False  # in host memory, not the GPU's


@dataclass(frozen=True)
class ModelSizes:
    """What the plan reads from the file, once; ``plan`` sizes it for settings."""

    spec: ModelSpec
    hp: HybridSpec | None
    qp: Qwen4ExpSpec | None
    weights: int  # file-layout matrices and float32 vectors, head and token embedding apart
    head: int  # the output projection's blocks (the token embedding's when tied)
    embedding: int  # the float32 token table
    scratch: int  # f16 scratch of long prompts: W tiles of at most SCRATCH_BYTES
    ple_table: int  # host bytes of the PLE table (0: none)

    @classmethod
    def of(cls, g: GGUFFile) -> ModelSizes:
        hp = qp = None
        if g.architecture in HYBRID_ARCHS:
            spec, hp = hybrid_spec_from_gguf(g)
            if spec.arch == "qwen4exp":
                qp = qwen4exp_spec_from_gguf(g, hp.recurrent, spec.n_rot)
        else:
            spec = spec_from_gguf(g)
        weights = head = scratch = ple = 0
        for t in g:
            if t.name == PLE_TABLE:
                ple = t.n_bytes
                continue
            if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= spec.n_layer:
                continue  # appended MTP (nextn) layers: not loaded
            if t.name == ("token_embd.weight" if spec.tied_output else "output.weight"):
                head = t.n_bytes
            elif t.name != "token_embd.weight":
                weights += _device_bytes(t)
            if not _is_vector(t) and len(t.shape) == 2:  # the matrices prompts multiply
                k, rows = t.shape[0], prod(t.shape[1:])
                scratch = max(scratch, min(rows, max(1, SCRATCH_BYTES // (2 * k))) * k * 2)
        if qp is not None and hp is not None:  # qwen4exp's DeltaNet: out_heads, int32 [H_v]
            weights += 4 * sum(hp.recurrent) * hp.ssm_v_heads
        table = 4 * spec.n_vocab * spec.n_embd
        return cls(spec, hp, qp, weights, head, table, scratch, ple)

    # -- per-slot sizes ---------------------------------------------------------------------------

    @property
    def attn_layers(self) -> int:
        return self.spec.n_layer - (sum(self.hp.recurrent) if self.hp else 0)

    @property
    def rewindable(self) -> bool:
        return self.hp is None or not any(self.hp.recurrent)

    def kv(self, n_ctx: int, type_k: str, type_v: str) -> int:
        """One slot's K and V, every attention layer."""
        n = n_ctx * self.spec.kv_dim
        return self.attn_layers * (kv_bytes(type_k, n) + kv_bytes(type_v, n))

    def blocks(self, n_ctx: int) -> int:
        """One slot's QSA block keys (float32), every QSA layer."""
        qp = self.qp
        if qp is None or not qp.qsa_layers:
            return 0
        return 4 * len(qp.qsa_layers) * (n_ctx // qp.ratio) * qp.idx_dim

    @property
    def recurrent(self) -> int:
        """One slot's state that only goes forward (float32): DeltaNet conv and recurrent states,
        QSA pending keys, the PLE conv history. A checkpoint is this size."""
        hp, qp, floats = self.hp, self.qp, 0
        if hp is not None:
            per_layer = max(hp.ssm_conv - 1, 0) * hp.conv_dim + hp.ssm_v_heads * hp.ssm_head_dim**2
            floats += sum(hp.recurrent) * per_layer
        if qp is not None:
            floats += len(qp.qsa_layers) * qp.ratio * qp.idx_dim
            if qp.ple is not None:
                floats += qp.ple.history * qp.hc * self.spec.n_embd
        return 4 * floats

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
        return streams + mixer + ffn + max(s.n_ff, d)  # + an f16 copy of the widest input

    def workspace(self, n_ctx: int, n_slots: int, batch: int) -> int:
        """Bytes the steps allocate beyond weights and pools (estimate; the caching allocator
        keeps a step's peak): a prompt chunk of ``batch`` tokens, the decode graphs' pool for
        ``n_slots`` sessions, the sampler's [B, V] rows and the f16 weight scratch."""
        s, qp = self.spec, self.qp
        per_token = 4 * self._token_floats()
        b = next((x for x in BUCKETS if x >= n_slots), BUCKETS[-1])
        v = s.n_vocab
        prompt = batch * per_token + 4 * min(batch, n_slots) * v
        if self.hp is not None and any(self.hp.recurrent):  # DeltaNet prefill pieces
            prompt += 4 * min(batch, PREFILL_PIECE) * self.hp.conv_dim
        decode = b * (per_token + 4 * v) + 4 * b * s.n_head * MAX_SPLITS * (s.head_dim + 2)
        if qp is not None and qp.qsa_layers:  # QSA block scores and the prompt's visibility masks
            cols = -(-(n_ctx // qp.ratio) // 4) * 4
            prompt += 8 * batch * cols + 4 * batch * (n_ctx // 32)
            prompt += 6 * min(batch * n_ctx, VIS_ELEMS)
            decode += 8 * b * cols
        sampler = SAMPLER_ROW_PASSES * 4 * b * (v + 1)
        scratch = self.scratch if batch >= HGemmTuning().min_rows else 0
        return prompt + decode + sampler + scratch


def plan(sizes: ModelSizes, settings: Settings) -> list[Item]:
    """The plan's items for ``settings`` (resolved for the model: ``Settings.for_model``)."""
    s, spec = settings, sizes.spec
    n_ctx, n_slots, pools = s.ctx_size, s.parallel, s.parallel + 1
    types = f"K {s.cache_type_k}, V {s.cache_type_v}"
    kv = sizes.kv(n_ctx, s.cache_type_k, s.cache_type_v)
    items = [
        Item("weights", sizes.weights, "matrices in GGUF blocks, vectors float32"),
        Item(
            "output head",
            sizes.head,
            "the token embedding's blocks (tied)" if spec.tied_output else "GGUF blocks",
        ),
        Item("token embedding", sizes.embedding, f"float32 [{spec.n_vocab}, {spec.n_embd}]"),
        Item("KV cache", kv * pools, f"{human(kv)} per slot ({types}, {n_ctx} tokens) x {pools}"),
    ]
    blocks = sizes.blocks(n_ctx)
    if blocks:
        items.append(Item("QSA block keys", blocks * pools, f"{human(blocks)} per slot x {pools}"))
    rec = sizes.recurrent
    if rec:
        items.append(Item("recurrent state", rec * pools, f"{human(rec)} per slot x {pools}"))
    if not sizes.rewindable and s.ctx_checkpoints:
        n = n_slots * s.ctx_checkpoints
        items.append(
            Item("device checkpoints", n * rec, f"{s.ctx_checkpoints} per slot x {n_slots} slots")
        )
        on_host = (s.cache_ram << 20) // rec
        detail = f"at most {on_host} in --cache-ram {s.cache_ram} MiB"
        items.append(Item("host checkpoints", on_host * rec, detail, True))
    work = sizes.workspace(n_ctx, n_slots, s.batch_size)
    items.append(Item("workspace", work, f"estimate: {s.batch_size}-token prompt chunk, decode"))
    if sizes.ple_table:
        items.append(Item("PLE table", sizes.ple_table, "memory-mapped, read row by row", True))
    return items


def device_total(items: list[Item]) -> int:
    return sum(i.nbytes for i in items if not i.host)


def human(n: int) -> str:
    """Bytes in the unit that reads best."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
