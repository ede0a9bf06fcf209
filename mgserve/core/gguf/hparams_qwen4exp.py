"""``Qwen4ExpSpec``: what ``qwen4exp`` adds to the qwen3next hyperparameters (hparams_hybrid.py).

Read from the keys llama.cpp's loader reads (src/models/qwen4exp.cpp ``load_arch_hparams``):
- hyper-connections: ``hyper_connection.count`` residual streams mixed through ``low_rank``;
- QSA: ``attention.indexer.{head_count,key_length,top_k}`` (top_k is the budget in tokens: whole
  blocks of ``attention.compress_ratios[il]`` tokens; 0 there means dense attention);
- M-RoPE: ``rope.dimension_sections``. For text every token's t/h/w positions are equal, so the
  interleaved M-RoPE is NeoX RoPE on the first ``rope.dimension_count`` dims, provided every rotated
  pair falls in a t/h/w section (the 4th section has position 0 for text);
- PLE: ``ple.layers`` (0-based; one layer), n-gram size, heads per n-gram, conv kernel, the EOS that
  resets n-grams, per-position hash multipliers and each head's row range in
  ``per_layer_token_embd`` (whose row width is ``embedding_length_per_layer_input``).
"""

from __future__ import annotations

from dataclasses import dataclass

from mgserve.core.gguf.reader import GGUFError, GGUFFile


def ple_head_count(ngram: int, heads_per_ngram: int) -> int:
    """Table lookups per token: ``heads_per_ngram`` for each n-gram 2..``ngram``."""
    return (ngram - 1) * heads_per_ngram


@dataclass(frozen=True)
class PleSpec:
    layer: int  # 0-based layer that adds the n-gram embedding
    ngram: int  # largest n-gram (n-grams 2..ngram are hashed)
    heads_per_ngram: int
    conv_kernel: int  # taps of the dilated (by ``ngram``) depthwise conv
    eos: int  # token id that resets the n-gram window
    head_dim: int  # row width of the table
    multipliers: tuple[int, ...]  # [ngram] odd 64-bit hash multipliers, one per position back
    offsets: tuple[int, ...]  # [n_heads] first table row of each head
    sizes: tuple[int, ...]  # [n_heads] rows of each head (primes)

    @property
    def n_heads(self) -> int:
        return ple_head_count(self.ngram, self.heads_per_ngram)

    @property
    def history(self) -> int:  # conv inputs a session keeps: (kernel - 1) * dilation
        return (self.conv_kernel - 1) * self.ngram


@dataclass(frozen=True)
class Qwen4ExpSpec:
    hc: int  # residual streams
    hc_lowrank: int
    idx_heads: int  # QSA indexer query heads (one key head)
    idx_dim: int
    idx_budget: int  # tokens of whole blocks each query may select
    compress: tuple[int, ...]  # per layer: tokens per indexer block (0: no QSA)
    ple: PleSpec | None

    @property
    def ratio(self) -> int:  # tokens per indexer block (one value for all QSA layers)
        return max(self.compress)

    @property
    def qsa_layers(self) -> tuple[int, ...]:
        return tuple(il for il, r in enumerate(self.compress) if r)


def _int_or_list(raw: object, n: int) -> list[int]:
    """A ``get_key_or_arr`` value: an array as is, a scalar repeated ``n`` times."""
    if isinstance(raw, bool | int | float):
        return [int(raw)] * n
    return [int(x) for x in raw]  # type: ignore[attr-defined]


def _ints(g: GGUFFile, key: str, n: int) -> tuple[int, ...]:
    raw = g.require(key)
    values = tuple(int(x) for x in raw)
    if len(values) < n:
        raise GGUFError(f"{g.path}: {key} has {len(values)} entries, at least {n} are required")
    return values[:n]


def _ple(g: GGUFFile, a: str, recurrent: tuple[bool, ...]) -> PleSpec | None:
    layers = g.get(f"{a}.ple.layers")
    if not layers:
        return None
    if len(layers) != 1:
        raise GGUFError(f"{g.path}: {a}.ple.layers lists {len(layers)} layers; one is supported")
    layer, ngram = int(layers[0]), int(g.require(f"{a}.ple.ngram_size"))
    if not 0 <= layer < len(recurrent) or not recurrent[layer]:
        raise GGUFError(f"{g.path}: PLE layer {layer} is not a linear attention layer")
    per = int(g.require(f"{a}.ple.heads_per_ngram"))
    n_heads = ple_head_count(ngram, per)
    if ngram < 2 or per < 1:
        raise GGUFError(f"{g.path}: PLE n-gram size {ngram} x {per} heads is out of range")
    return PleSpec(
        layer=layer,
        ngram=ngram,
        heads_per_ngram=per,
        conv_kernel=int(g.require(f"{a}.ple.conv_kernel")),
        eos=int(g.require(f"{a}.ple.eos_token_id")),
        head_dim=int(g.require(f"{a}.embedding_length_per_layer_input")),
        multipliers=_ints(g, f"{a}.ple.layer_multipliers", ngram),
        offsets=_ints(g, f"{a}.ple.head_offsets", n_heads),
        sizes=_ints(g, f"{a}.ple.head_vocab_sizes", n_heads),
    )


def qwen4exp_spec_from_gguf(g: GGUFFile, recurrent: tuple[bool, ...], n_rot: int) -> Qwen4ExpSpec:
    """The qwen4exp extras of ``g``; ``recurrent`` and ``n_rot`` come from the hybrid spec."""
    a = g.architecture
    n_layer = len(recurrent)
    sections = _int_or_list(g.require(f"{a}.rope.dimension_sections"), 4)[:4]
    sect = sum(sections)
    for i in range(n_rot // 2):  # ggml's imrope: pair i, sector s = i % sum, reads t/h/w (s % 3)
        s = i % sect if sect else 0  # while s < 3 * that section's size, else the 4th section
        if not any(s % 3 == j and s < 3 * sections[j] for j in range(3)):
            raise GGUFError(f"{g.path}: rotated pair {i} reads the 4th M-RoPE section (not text)")
    ratios = tuple(_int_or_list(g.get(f"{a}.attention.compress_ratios", 0), n_layer))
    if len(ratios) < n_layer:
        raise GGUFError(f"{g.path}: {a}.attention.compress_ratios has too few entries")
    spec = Qwen4ExpSpec(
        hc=int(g.require(f"{a}.hyper_connection.count")),
        hc_lowrank=int(g.require(f"{a}.hyper_connection.low_rank")),
        idx_heads=int(g.get(f"{a}.attention.indexer.head_count", 0)),
        idx_dim=int(g.get(f"{a}.attention.indexer.key_length", 0)),
        idx_budget=int(g.get(f"{a}.attention.indexer.top_k", 0)),
        compress=tuple(r if not rec else 0 for r, rec in zip(ratios, recurrent, strict=False)),
        ple=_ple(g, a, recurrent),
    )
    if spec.hc < 2 or spec.hc_lowrank < 1:
        raise GGUFError(f"{g.path}: hyper-connections need count >= 2 and low_rank >= 1")
    if any(spec.compress) and min(spec.idx_heads, spec.idx_dim, spec.idx_budget) < 1:
        raise GGUFError(f"{g.path}: QSA layers need positive attention.indexer.* keys")
    if len(set(spec.compress) - {0}) > 1:
        raise GGUFError(f"{g.path}: QSA layers with different compress ratios are not supported")
    if spec.ratio and spec.idx_budget % spec.ratio:
        raise GGUFError(
            f"{g.path}: indexer top_k {spec.idx_budget} is not a multiple of {spec.ratio}"
        )
    if any(spec.compress) and n_rot > spec.idx_dim:
        raise GGUFError(f"{g.path}: {n_rot} rotated dims do not fit the {spec.idx_dim}-dim indexer")
    return spec
