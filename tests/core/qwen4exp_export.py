"""A tiny random Qwen4ExpForCausalLM (transformers 5.23) and its GGUF (F32) export, for tests.

The exporter follows llama.cpp's converter (conversion/qwen4exp.py on top of qwen.py's
``_LinearAttentionVReorderBase`` and ``Qwen3NextModel``):
- every ``*norm.weight`` but the DeltaNet's gated ``linear_attn.norm`` is stored 1 + w (HF's
  RMSNorm is zero-centred), and so are the PLE ``norm_key/query/conv`` and indexer layernorms;
- DeltaNet value heads are reordered from grouped (per key head) to tiled order, in the V rows of
  ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``/``in_proj_a`` (-> ``ssm_beta``/``ssm_alpha``),
  ``A_log`` (-> ``ssm_a = -exp``), ``dt_bias``, the conv's V channels and ``out_proj``'s columns;
- the indexer's ``index_qk_proj`` is split into ``indexer.q_proj`` and ``indexer.k_proj``;
- hyper-connection and PLE norms keep the checkpoint's 1-D [hc * d], as the converter writes them
  (``grouped_norms=True`` writes them [d, hc] instead: the shape llama.cpp's loader asks for, which
  it also accepts); conv kernels squeezed;
- ``ple_layer_ids`` (1-based) become ``ple.layers`` (0-based); the hash constants go to metadata.
``sparse_ple_rows`` declares a much larger PLE table whose data is a hole in a sparse file (rows
read as zeros), to measure what loading costs in memory without writing gigabytes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType, GGUFValueType

from mgserve.core.gguf.writer import GGUFWriter, tensor_nbytes
from mgserve.core.synth.shapes import _is_prime
from mgserve.core.synth.vocab import SynthVocab
from tests.hf_version import pinned_transformers

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ARCH = "qwen4exp"
VOCAB = SynthVocab(320, "qwen35", endoftext_id=317, im_start_id=318, im_end_id=319)
U32, U64, I32, F32 = (
    GGUFValueType.UINT32,
    GGUFValueType.UINT64,
    GGUFValueType.INT32,
    GGUFValueType.FLOAT32,
)


def hf_config(**changes: Any) -> Any:
    """The issue's tiny config: hidden 256, 8 layers (3, 7 indexed attention), QSA budget 64."""
    tf = pinned_transformers()

    kw: dict[str, Any] = dict(
        vocab_size=VOCAB.n_vocab,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=96,
        hc_lowrank=32,
        ple_layer_ids=[2],  # 1-based: layer 1, where the real model has it
        ngram_vocab_size_base=1000,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=32,
        indexer_budget=64,
        indexer_compress_ratio=4,
        output_gate_type="sigmoid",
        eos_token_id=VOCAB.im_end_id,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
    )
    kw.update(changes)
    cfg = tf.Qwen4ExpTextConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def hf_model(seed: int = 0, **changes: Any) -> Any:
    """The tiny model with every parameter shaken off its init value, eval mode, float32."""
    tf = pinned_transformers()

    torch.manual_seed(seed)
    model = tf.Qwen4ExpForCausalLM(hf_config(**changes)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.5 if "ngram_embedding" in name else 0.1))
    return model


def _tile_v(x: torch.Tensor, dim: int, cfg: Any, width: int) -> torch.Tensor:
    """Value heads from grouped (per key head) to tiled order along ``dim``."""
    hk, r = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads
    shape = list(x.shape)
    dim %= len(shape)
    grouped = x.reshape(*shape[:dim], hk, r, width, *shape[dim + 1 :])
    return grouped.transpose(dim, dim + 1).reshape(shape)


def gguf_tensors(model: Any, grouped_norms: bool = False) -> dict[str, torch.Tensor]:
    """llama.cpp tensor names -> float32 tensors in torch order ([out, in])."""
    cfg = model.config

    def _hc_norm(w: torch.Tensor, cfg: Any) -> torch.Tensor:  # [hc * d], or [hc, d] == GGUF [d, hc]
        return (w + 1.0).view(cfg.hc_count, cfg.hidden_size) if grouped_norms else w + 1.0

    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    dv, n_idx_q = cfg.linear_value_head_dim, cfg.indexer_n_heads * cfg.indexer_head_dim
    out: dict[str, torch.Tensor] = {"token_embd.weight": sd["model.embed_tokens.weight"]}
    for il in cfg.ple_layer_ids:
        p = f"model.layers.{il - 1}.ple.ple_embedding.ngram_embedding.weight"
        out["per_layer_token_embd.weight"] = sd[p]
    mixer = "model.hyper_connection_mixer."
    out["output_hc_norm.weight"] = _hc_norm(sd[mixer + "hc_norm.weight"], cfg)
    out["output_hc_down.weight"] = sd[mixer + "input_mix_weight_down.weight"]
    out["output_hc_up.weight"] = sd[mixer + "input_mix_weight_up.weight"]
    out["output.weight"] = sd["lm_head.weight"]
    simple = {
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate.weight": "ffn_gate_inp.weight",
        "mlp.experts.down_proj": "ffn_down_exps.weight",
        "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
        "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
        "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
        "linear_attn.norm.weight": "ssm_norm.weight",
        "ple.key_proj.weight": "ple_key.weight",
        "ple.value_proj.weight": "ple_value.weight",
    }
    plus_one = {
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        "self_attn.indexer.q_layernorm.weight": "indexer.q_norm.weight",
        "self_attn.indexer.k_layernorm.weight": "indexer.k_norm.weight",
    }
    hc_norms = {
        "attn_hyper_connection.hc_norm.weight": "hc_attn_norm.weight",
        "mlp_hyper_connection.hc_norm.weight": "hc_ffn_norm.weight",
        "ple.norm_key.weight": "ple_norm_key.weight",
        "ple.norm_query.weight": "ple_norm_query.weight",
        "ple.norm_conv.weight": "ple_norm_conv.weight",
    }
    hc_mats = {"input_mix_weight_down": "down", "input_mix_weight_up": "up"}
    hc_mats |= {"block_inject_weight": "inject"}
    for key, value in sd.items():
        if not key.startswith("model.layers."):
            continue
        il, rest = key.removeprefix("model.layers.").split(".", 1)
        p = f"blk.{il}."
        if rest in simple:
            out[p + simple[rest]] = value
        elif rest in plus_one:
            out[p + plus_one[rest]] = value + 1.0
        elif rest in hc_norms:
            out[p + hc_norms[rest]] = _hc_norm(value, cfg)
        elif "_hyper_connection." in rest:
            part = "attn" if rest.startswith("attn_") else "ffn"
            out[p + f"hc_{part}_{hc_mats[rest.split('.')[1]]}.weight"] = value
        elif rest == "mlp.experts.gate_up_proj":
            ff = value.shape[1] // 2
            out[p + "ffn_gate_exps.weight"] = value[:, :ff]
            out[p + "ffn_up_exps.weight"] = value[:, ff:]
        elif rest == "mlp.shared_expert_gate.weight":
            out[p + "ffn_gate_inp_shexp.weight"] = value[0]
        elif rest == "self_attn.indexer.index_qk_proj.weight":
            out[p + "indexer.q_proj.weight"] = value[:n_idx_q]
            out[p + "indexer.k_proj.weight"] = value[n_idx_q:]
        elif rest == "ple.conv1d.weight":
            out[p + "ple_conv1d.weight"] = value.squeeze(1)
        elif rest == "linear_attn.in_proj_qkv.weight":
            v = _tile_v(value[2 * key_dim :], 0, cfg, dv)
            out[p + "attn_qkv.weight"] = torch.cat([value[: 2 * key_dim], v])
        elif rest == "linear_attn.conv1d.weight":
            w = value.squeeze(1)
            out[p + "ssm_conv1d.weight"] = torch.cat(
                [w[: 2 * key_dim], _tile_v(w[2 * key_dim :], 0, cfg, dv)]
            )
        elif rest == "linear_attn.in_proj_z.weight":
            out[p + "attn_gate.weight"] = _tile_v(value, 0, cfg, dv)
        elif rest == "linear_attn.in_proj_b.weight":
            out[p + "ssm_beta.weight"] = _tile_v(value, 0, cfg, 1)
        elif rest == "linear_attn.in_proj_a.weight":
            out[p + "ssm_alpha.weight"] = _tile_v(value, 0, cfg, 1)
        elif rest == "linear_attn.A_log":
            out[p + "ssm_a"] = -torch.exp(_tile_v(value, 0, cfg, 1))
        elif rest == "linear_attn.dt_bias":
            out[p + "ssm_dt.bias"] = _tile_v(value, 0, cfg, 1)
        elif rest == "linear_attn.out_proj.weight":
            out[p + "ssm_out.weight"] = _tile_v(value, 1, cfg, dv)
        elif "ple_embedding." in rest:
            continue  # the table is global (per_layer_token_embd), the constants metadata
        else:
            raise KeyError(f"no GGUF name for {key}")
    return {k: v.contiguous() for k, v in out.items()}


def _ple_constants(model: Any) -> dict[str, list[int]]:
    (il,) = model.config.ple_layer_ids
    emb = model.model.layers[il - 1].ple.ple_embedding
    return {
        "multipliers": emb.layer_multipliers.tolist(),
        "offsets": emb.ngram_heads_offsets.tolist(),
        "sizes": emb.ngram_heads_vocab_sizes.tolist(),
    }


def _sparse_heads(rows: int, heads: int) -> tuple[list[int], list[int]]:
    """Head ranges that spread ``heads`` prime-sized heads over a table of ``rows`` rows."""
    sizes = []
    for _ in range(heads):
        p = rows // heads
        while not _is_prime(p):
            p -= 1
        sizes.append(p)
    return [h * (rows // heads) for h in range(heads)], sizes


def metadata(model: Any, sparse_ple_rows: int | None = None) -> dict[str, tuple[Any, Any]]:
    """The keys convert_hf_to_gguf.py writes for qwen4exp, with llama.cpp's types."""
    cfg = model.config
    a = ARCH
    ple = _ple_constants(model)
    if sparse_ple_rows is not None:
        ple["offsets"], ple["sizes"] = _sparse_heads(sparse_ple_rows, len(ple["sizes"]))
    sections = [*cfg.rope_parameters["mrope_section"], 0]
    ratios = [cfg.indexer_compress_ratio if t != "linear_attention" else 0 for t in cfg.layer_types]
    head_dim_ple = cfg.ple_embed_dim // ((cfg.ngram_size - 1) * cfg.heads_per_ngram)
    md: dict[str, tuple[Any, Any]] = {
        "general.name": ("tiny qwen4exp", None),
        "general.file_type": (0, U32),
        f"{a}.context_length": (cfg.max_position_embeddings, U32),
        f"{a}.embedding_length": (cfg.hidden_size, U32),
        f"{a}.block_count": (cfg.num_hidden_layers, U32),
        f"{a}.feed_forward_length": (cfg.intermediate_size, U32),
        f"{a}.attention.head_count": (cfg.num_attention_heads, U32),
        f"{a}.attention.head_count_kv": (cfg.num_key_value_heads, U32),
        f"{a}.attention.key_length": (cfg.head_dim, U32),
        f"{a}.attention.value_length": (cfg.head_dim, U32),
        f"{a}.attention.layer_norm_rms_epsilon": (float(cfg.rms_norm_eps), F32),
        f"{a}.rope.freq_base": (float(cfg.rope_parameters["rope_theta"]), F32),
        f"{a}.rope.dimension_count": (int(cfg.head_dim * 0.25), U32),
        f"{a}.rope.dimension_sections": (sections, I32),
        f"{a}.expert_count": (cfg.num_experts, U32),
        f"{a}.expert_used_count": (cfg.num_experts_per_tok, U32),
        f"{a}.expert_feed_forward_length": (cfg.moe_intermediate_size, U32),
        f"{a}.expert_shared_feed_forward_length": (cfg.shared_expert_intermediate_size, U32),
        f"{a}.ssm.conv_kernel": (cfg.linear_conv_kernel_dim, U32),
        f"{a}.ssm.state_size": (cfg.linear_key_head_dim, U32),
        f"{a}.ssm.group_count": (cfg.linear_num_key_heads, U32),
        f"{a}.ssm.time_step_rank": (cfg.linear_num_value_heads, U32),
        f"{a}.ssm.inner_size": (cfg.linear_value_head_dim * cfg.linear_num_value_heads, U32),
        f"{a}.attention.recurrent_layers": (
            [t == "linear_attention" for t in cfg.layer_types],
            GGUFValueType.BOOL,
        ),
        f"{a}.full_attention_interval": (cfg.layer_types.index("indexed_attention") + 1, U32),
        f"{a}.hyper_connection.count": (cfg.hc_count, U32),
        f"{a}.hyper_connection.low_rank": (cfg.hc_lowrank, U32),
        f"{a}.attention.indexer.head_count": (cfg.indexer_n_heads, U32),
        f"{a}.attention.indexer.key_length": (cfg.indexer_head_dim, U32),
        f"{a}.attention.indexer.top_k": (cfg.indexer_budget, U32),
        f"{a}.attention.compress_ratios": (ratios, I32),
        f"{a}.ple.layers": ([i - 1 for i in cfg.ple_layer_ids], U32),
        f"{a}.ple.ngram_size": (cfg.ngram_size, U32),
        f"{a}.ple.heads_per_ngram": (cfg.heads_per_ngram, U32),
        f"{a}.ple.conv_kernel": (cfg.ple_conv_kernel_size, U32),
        f"{a}.ple.eos_token_id": (cfg.eos_token_id, U32),
        f"{a}.embedding_length_per_layer_input": (head_dim_ple, U32),
        f"{a}.ple.layer_multipliers": (ple["multipliers"], U64),
        f"{a}.ple.head_offsets": (ple["offsets"], U64),
        f"{a}.ple.head_vocab_sizes": (ple["sizes"], U64),
    }
    md.update(VOCAB.metadata())
    return md


class _SparseWriter(GGUFWriter):
    """A writer that can leave one tensor's data as a hole (reads back as zeros)."""

    def skip_tensor_data(self, name: str) -> None:
        assert self._file is not None and self._order[self._next] == name
        self._file.seek(self._padded(self._tensors[name][2]), os.SEEK_CUR)
        self._next += 1


def export(
    model: Any,
    path: Path,
    sparse_ple_rows: int | None = None,
    overrides: dict[str, tuple[Any, Any]] | None = None,
    grouped_norms: bool = False,
) -> Path:
    """The tiny HF ``model`` as an F32 GGUF file at ``path`` (see the module docstring);
    ``overrides`` replaces metadata entries (key -> (value, GGUF type)), to make bad files."""
    tensors = gguf_tensors(model, grouped_norms)
    tensors = {k: v.numpy().astype(np.float32) for k, v in tensors.items()}
    table = "per_layer_token_embd.weight"
    shapes = {k: tuple(reversed(v.shape)) for k, v in tensors.items()}
    order = list(tensors)
    if sparse_ple_rows is not None:  # the hole goes last, so the file ends with it
        shapes[table] = (shapes[table][0], sparse_ple_rows)
        order.remove(table)
        order.append(table)
    writer = _SparseWriter(path, ARCH)
    with writer as w:
        for key, (value, vtype) in (metadata(model, sparse_ple_rows) | (overrides or {})).items():
            w.add(key, value, vtype)
        for name in order:
            w.add_tensor_info(name, shapes[name], GGMLQuantizationType.F32)
        w.write_header()
        for name in order:
            if sparse_ple_rows is not None and name == table:
                writer.skip_tensor_data(name)
            else:
                w.write_tensor_data(name, tensors[name])
        end = w._file.tell() if w._file is not None else 0
    os.truncate(path, max(end, path.stat().st_size))
    return path


def table_nbytes(model: Any, rows: int) -> int:
    """Bytes of an F32 PLE table of ``rows`` rows for ``model``."""
    cfg = model.config
    width = cfg.ple_embed_dim // ((cfg.ngram_size - 1) * cfg.heads_per_ngram)
    return tensor_nbytes((width, rows), GGMLQuantizationType.F32)


def prompt_tokens(n: int, seed: int = 1, eos_every: int = 0) -> torch.Tensor:
    """[n] int64 random ordinary ids; ``eos_every``: an EOS (PLE's n-gram reset) every so often."""
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, VOCAB.endoftext_id, (n,), generator=g)
    if eos_every:
        toks[eos_every - 1 :: eos_every] = VOCAB.im_end_id
    return toks


def write_synth_qwen4exp(path: Path) -> Path:
    """A tiny qwen4exp in the real files' layout and quant mix (Q4_K/Q5_0 experts, Q8_0 PLE table
    and beta/alpha, BF16 hyper-connections and indexer, F32 norms), random weights, written by
    ``mgserve synth``'s writer."""
    import dataclasses

    from mgserve.core.synth.shapes import QWEN4EXP_FLASH_NEXT
    from mgserve.core.synth.write import write_synth

    spec = dataclasses.replace(
        QWEN4EXP_FLASH_NEXT,
        name="tiny qwen4exp (synthetic, quantized)",
        n_layer=4,
        n_embd=256,  # K-quants need rows that are multiples of 256
        n_ctx=512,
        vocab=SynthVocab(512, "qwen35", endoftext_id=509, im_start_id=510, im_end_id=511),
        n_head=4,
        n_head_kv=2,
        head_dim=64,
        n_rot=16,
        rope_sections=(3, 3, 2, 0),
        ssm_k_heads=2,
        ssm_v_heads=4,
        ssm_head_dim=64,
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=256,
        n_ff_shexp=256,
        hc_lowrank=32,
        indexer_heads=2,
        indexer_dim=32,
        indexer_top_k=64,
        ple_dim=16,  # 16 heads x 16 = n_embd, as llama.cpp's ple_key shape requires
        ple_rows=20000,
        image_token_id=0,
    )
    # the mix the recorded llama.cpp reference (and its gguf_sha256) was made with
    return write_synth(spec, path, seed=1, mix="ud-q4_k_xl").path
