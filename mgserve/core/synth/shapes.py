"""The named shapes ``mgserve synth`` writes: hyperparameters, tensor list and GGUF metadata.

Names, shapes and keys follow the vendored llama.cpp loader (``src/models/qwen4exp.cpp`` and
``qwen3next.cpp`` ``load_arch_hparams``/``load_arch_tensors``, ``src/llama-arch.cpp`` name tables)
and ``conversion/qwen4exp.py``; hyperparameters come from SEED.md and transformers' ``qwen4_exp``
config. Shapes are in GGUF order (``shape[0]`` is the contiguous row), as llama.cpp's
``create_tensor`` spells them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from gguf.constants import GGUFValueType

from mgserve.core.gguf.hparams_qwen4exp import ple_head_count
from mgserve.core.synth.vocab import SynthVocab

U32, U64, I32 = GGUFValueType.UINT32, GGUFValueType.UINT64, GGUFValueType.INT32
Metadata = dict[str, tuple[Any, GGUFValueType | None]]  # key -> (value, explicit type or None)


@dataclass(frozen=True)
class ShapeSpec:
    arch: str  # GGUF general.architecture
    name: str  # general.name
    n_layer: int
    n_embd: int
    n_ctx: int
    vocab: SynthVocab
    n_head: int  # full-attention query heads
    n_head_kv: int
    head_dim: int
    n_rot: int  # rotary dims of a head (partial rotary)
    rope_base: float
    rope_sections: tuple[int, ...] | None  # M-RoPE sections (qwen4exp), None for plain NeoX rope
    ssm_conv: int  # Gated DeltaNet causal conv kernel
    ssm_k_heads: int  # ssm.group_count
    ssm_v_heads: int  # ssm.time_step_rank
    ssm_head_dim: int  # ssm.state_size: both key and value head dim
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int
    full_attn_interval: int = 4
    rms_eps: float = 1e-6
    hc: int = 0  # hyper-connection streams; 0: plain pre-norm residual (qwen3next)
    hc_lowrank: int = 0
    indexer_heads: int = 0  # QSA indexer; 0: no indexer
    indexer_dim: int = 0
    indexer_top_k: int = 0
    compress_ratio: int = 0  # tokens per indexer block
    ple_layer: int | None = None  # 0-based layer holding the n-gram hash embedding
    ple_ngram: int = 3
    ple_heads_per_ngram: int = 8
    ple_dim: int = 0  # row width of the table (head dim)
    ple_rows: int | None = None  # table rows; None: the real ~320M-row table
    ple_conv: int = 4
    image_token_id: int = 0

    @property
    def ple_heads(self) -> int:
        return ple_head_count(self.ple_ngram, self.ple_heads_per_ngram)

    def is_recurrent(self, il: int) -> bool:
        return (il + 1) % self.full_attn_interval != 0

    def shrink(
        self, *, experts: int | None = None, ple_rows: int | None = None, layers: int | None = None
    ) -> ShapeSpec:
        """The same widths with fewer experts, PLE rows or layers, to fit a disk."""
        changes: dict[str, Any] = {}
        if experts is not None:
            if not 1 <= experts <= self.n_expert:
                raise ValueError(f"--experts must be in [1, {self.n_expert}], got {experts}")
            changes["n_expert"] = experts
            changes["n_expert_used"] = min(self.n_expert_used, experts)
        if layers is not None:
            low = 1 if self.ple_layer is None else self.ple_layer + 1
            if not low <= layers <= self.n_layer:
                raise ValueError(f"--layers must be in [{low}, {self.n_layer}], got {layers}")
            changes["n_layer"] = layers
        if ple_rows is not None:
            if self.ple_layer is None:
                raise ValueError(f"--ple-rows: shape {self.arch} has no PLE table")
            if ple_rows < 4 * self.ple_heads:
                raise ValueError(
                    f"--ple-rows must be at least {4 * self.ple_heads}, got {ple_rows}"
                )
            changes["ple_rows"] = ple_rows
        return dataclasses.replace(self, **changes)


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def ple_table(spec: ShapeSpec) -> tuple[list[int], list[int], int]:
    """(head offsets, head vocab sizes, table rows) of the PLE n-gram hash embedding.

    The real model (``ple_rows`` None) gives head h the (h+1)-th prime after 20M and pads the
    total (~320M rows) to a multiple of 128. A shrunk table gives each head the largest prime
    that fits its equal share, so the hash stays a modulus by a prime and every row index stays
    inside the table.
    """
    sizes: list[int] = []
    if spec.ple_rows is None:
        p = _PLE_VOCAB_BASE - 1
        for _ in range(spec.ple_heads):
            p += 1
            while not _is_prime(p):
                p += 1
            sizes.append(p)
        rows = -(-sum(sizes) // 128) * 128
    else:
        rows = spec.ple_rows
        p = rows // spec.ple_heads
        for _ in range(spec.ple_heads):
            while not _is_prime(p):
                p -= 1
            sizes.append(p)
    offsets = [sum(sizes[:h]) for h in range(len(sizes))]
    return offsets, sizes, rows


def ple_layer_multipliers(n_vocab: int, ngram: int, seed: int = 1234) -> list[int]:
    """Odd 64-bit hash multipliers, one per n-gram position (splitmix64 of a seeded counter)."""
    mask = (1 << 64) - 1
    half_bound = max(1, ((1 << 63) - 1) // max(n_vocab, 1) // 2)
    out = []
    for i in range(ngram):
        z = (seed + 0x9E3779B97F4A7C15 * (i + 1) + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        out.append(2 * ((z ^ (z >> 31)) % half_bound) + 1)
    return out


def metadata(spec: ShapeSpec, file_type: int) -> Metadata:
    """Every GGUF key the llama.cpp loader reads for ``spec.arch``, with llama.cpp's types;
    ``file_type`` is the quant mix's ``general.file_type`` (a ``LlamaFileType``)."""
    a = spec.arch
    # one row per key: a table of the file's metadata, its rows alike by nature
    md: Metadata = {
        "general.name": (spec.name, None),
        "general.file_type": (int(file_type), U32),
        "general.quantization_version": (2, U32),
        f"{a}.context_length": (spec.n_ctx, U32),
        f"{a}.embedding_length": (spec.n_embd, U32),
        f"{a}.block_count": (spec.n_layer, U32),
        f"{a}.attention.head_count": (spec.n_head, U32),
        f"{a}.attention.head_count_kv": (spec.n_head_kv, U32),
        f"{a}.attention.key_length": (spec.head_dim, U32),
        f"{a}.attention.value_length": (spec.head_dim, U32),
        f"{a}.attention.layer_norm_rms_epsilon": (spec.rms_eps, GGUFValueType.FLOAT32),
        f"{a}.rope.freq_base": (spec.rope_base, GGUFValueType.FLOAT32),
        f"{a}.rope.dimension_count": (spec.n_rot, U32),
        f"{a}.expert_count": (spec.n_expert, U32),
        f"{a}.expert_used_count": (spec.n_expert_used, U32),
        f"{a}.expert_feed_forward_length": (spec.n_ff_exp, U32),
        f"{a}.expert_shared_feed_forward_length": (spec.n_ff_shexp, U32),
        f"{a}.ssm.conv_kernel": (spec.ssm_conv, U32),
        f"{a}.ssm.state_size": (spec.ssm_head_dim, U32),
        f"{a}.ssm.group_count": (spec.ssm_k_heads, U32),
        f"{a}.ssm.time_step_rank": (spec.ssm_v_heads, U32),
        f"{a}.ssm.inner_size": (spec.ssm_v_heads * spec.ssm_head_dim, U32),
        f"{a}.full_attention_interval": (spec.full_attn_interval, U32),
    }
    if spec.rope_sections is not None:
        md[f"{a}.rope.dimension_sections"] = (list(spec.rope_sections), I32)
    if spec.hc:
        md[f"{a}.hyper_connection.count"] = (spec.hc, U32)
        md[f"{a}.hyper_connection.low_rank"] = (spec.hc_lowrank, U32)
    if spec.indexer_heads:
        md[f"{a}.attention.indexer.head_count"] = (spec.indexer_heads, U32)
        md[f"{a}.attention.indexer.key_length"] = (spec.indexer_dim, U32)
        md[f"{a}.attention.indexer.top_k"] = (spec.indexer_top_k, U32)
        ratios = [0 if spec.is_recurrent(il) else spec.compress_ratio for il in range(spec.n_layer)]
        md[f"{a}.attention.compress_ratios"] = (ratios, I32)
    if spec.ple_layer is not None:
        offsets, sizes, _ = ple_table(spec)
        mult = ple_layer_multipliers(spec.vocab.n_vocab, spec.ple_ngram)
        md[f"{a}.ple.layers"] = ([spec.ple_layer], U32)
        md[f"{a}.ple.ngram_size"] = (spec.ple_ngram, U32)
        md[f"{a}.ple.heads_per_ngram"] = (spec.ple_heads_per_ngram, U32)
        md[f"{a}.ple.conv_kernel"] = (spec.ple_conv, U32)
        md[f"{a}.ple.eos_token_id"] = (spec.vocab.im_end_id, U32)
        md[f"{a}.ple.image_token_id"] = (spec.image_token_id, U32)
        md[f"{a}.embedding_length_per_layer_input"] = (spec.ple_dim, U32)
        md[f"{a}.ple.layer_multipliers"] = (mult, U64)
        md[f"{a}.ple.head_offsets"] = (offsets, U64)
        md[f"{a}.ple.head_vocab_sizes"] = (sizes, U64)
    md.update(spec.vocab.metadata())
    return md


_PLE_VOCAB_BASE = 20_000_000

QWEN4EXP_FLASH_NEXT = ShapeSpec(
    arch="qwen4exp",
    name="Qwen3.8-Flash-Next (synthetic)",
    n_layer=48,
    n_embd=2560,
    n_ctx=262144,
    vocab=SynthVocab(
        248320,
        "qwen35",
        endoftext_id=248044,
        im_start_id=248045,
        im_end_id=248046,
        template="qwen35",  # the real model's tokenizer and chat template (Qwen3.5's)
    ),
    n_head=24,
    n_head_kv=2,
    head_dim=256,
    n_rot=64,
    rope_base=1e7,
    rope_sections=(11, 11, 10, 0),
    ssm_conv=4,
    ssm_k_heads=16,
    ssm_v_heads=48,
    ssm_head_dim=128,
    n_expert=512,
    n_expert_used=10,
    n_ff_exp=640,
    n_ff_shexp=640,
    hc=4,
    hc_lowrank=320,
    indexer_heads=4,
    indexer_dim=128,
    indexer_top_k=2048,  # 512 blocks x 4 tokens
    compress_ratio=4,
    ple_layer=1,
    ple_dim=160,
    image_token_id=248056,
)

QWEN3NEXT_80B_A3B = ShapeSpec(
    arch="qwen3next",
    name="Qwen3-Next-80B-A3B (synthetic)",
    n_layer=48,
    n_embd=2048,
    n_ctx=262144,
    vocab=SynthVocab(151936, "qwen2", endoftext_id=151643, im_start_id=151644, im_end_id=151645),
    n_head=16,
    n_head_kv=2,
    head_dim=256,
    n_rot=64,
    rope_base=1e7,
    rope_sections=None,
    ssm_conv=4,
    ssm_k_heads=16,
    ssm_v_heads=32,
    ssm_head_dim=128,
    n_expert=512,
    n_expert_used=10,
    n_ff_exp=512,
    n_ff_shexp=512,
)

SHAPES: dict[str, ShapeSpec] = {
    "qwen4exp-flash-next": QWEN4EXP_FLASH_NEXT,
    "qwen3next-80b-a3b": QWEN3NEXT_80B_A3B,
}
