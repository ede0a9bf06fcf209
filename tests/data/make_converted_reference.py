"""Convert tiny random qwen4exp / qwen3next checkpoints with llama.cpp's own converter, and record
llama.cpp's outputs on the result, for tests/core/test_converted_models.py.

Run once (needs llama-cpp-python, transformers 5.23 and the llama-cpp-python 0.3.36 sdist unpacked
at $LLAMA_CPP_SDIST, default /tmp/sdist/llama_cpp_python-0.3.36; CPU, ~1 min):
    python tests/data/make_converted_reference.py

For each model it
1. builds a tiny random HF checkpoint (transformers' ``Qwen4ExpForCausalLM`` /
   ``Qwen3NextForCausalLM``, every weight shaken off its init) and saves it as safetensors;
2. converts it in a child process that has the sdist's ``gguf-py`` and ``conversion`` package
   first on its path: the model class ``convert_hf_to_gguf.py`` would pick, subclassed only to
   replace ``set_vocab`` (the converter needs a real tokenizer whose hash it knows; we give the
   synthetic byte-level BPE vocabulary of mgserve's tests, ``tokenizer.ggml.pre`` qwen35 /
   qwen2). Tensors, shapes, types and hyperparameter keys are llama.cpp's conversion code's;
3. runs llama.cpp (llama-cpp-python) on the GGUF: a token-id prompt, a greedy continuation, and
   the logits of every position (F32 KV cache), stored as top-5 ids/logits per position and the
   full logits of the last prompt position and the last position.

The GGUF files (F32, small configs so each is well under 2 MB) are kept in tests/data/ as
``converted_{qwen4exp,qwen3next,llama}.gguf``; the records go to ``converted_llama_reference.json``.

- qwen4exp: QSA on blocks of 1 token with 8 indexer heads. llama.cpp ranks cells where the
  reference ranks blocks (see make_qwen4exp_reference.py); with blocks of one token the two are
  the same ranking, so llama.cpp and mgserve must agree at every position. The PLE table is split
  into ``split_ngram_parts`` shards in the checkpoint, as the released checkpoints store it (the
  converter joins them back).
- llama: a tiny Mixtral (``MixtralForCausalLM``), which the converter writes as architecture
  ``llama`` with 4 experts per layer (``ffn_gate_inp``, ``ffn_{gate,up,down}_exps``).
- qwen3next: the checkpoint also carries an MTP block (``mtp.*``, a copy of a full-attention layer
  plus the fc/norms), as the released Qwen3-Next checkpoints do; the converter appends it as block
  ``num_hidden_layers`` with ``nextn_predict_layers = 1``, which a loader must skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
OUT = DATA / "converted_llama_reference.json"
SDIST = Path(os.environ.get("LLAMA_CPP_SDIST", "/tmp/sdist/llama_cpp_python-0.3.36"))
N_PROMPT = 60
N_GEN = 8
VOCAB_N = 320


def _shake(make: Any, cfg: Any, seed: int) -> Any:
    """``make(cfg)`` built and then shaken under ``seed`` (the build draws random numbers too)."""
    torch.manual_seed(seed)
    model = make(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.5 if "ngram_embedding" in name else 0.1))
    return model.eval()


def qwen4exp_model() -> Any:
    import transformers as tf

    cfg = tf.Qwen4ExpTextConfig(
        vocab_size=VOCAB_N, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, hc_lowrank=8, ple_layer_ids=[2],
        ngram_vocab_size_base=300, split_ngram_parts=2, indexer_n_heads=8, indexer_kv_heads=1,
        indexer_head_dim=16, indexer_budget=16, indexer_compress_ratio=1,
        output_gate_type="sigmoid", eos_token_id=VOCAB_N - 1, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1], "mrope_interleaved": True,
        },
    )  # fmt: skip
    cfg.architectures = ["Qwen4ExpForCausalLM"]
    cfg._attn_implementation = "eager"
    return _shake(tf.Qwen4ExpForCausalLM, cfg, seed=0)


def qwen3next_model() -> Any:
    import transformers as tf

    cfg = tf.Qwen3NextConfig(
        vocab_size=VOCAB_N, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, full_attention_interval=4,
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=True,
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
        eos_token_id=VOCAB_N - 1,
        rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
        },
    )  # fmt: skip
    cfg.architectures = ["Qwen3NextForCausalLM"]
    cfg._attn_implementation = "eager"
    return _shake(tf.Qwen3NextForCausalLM, cfg, seed=1)


def mixtral_model() -> Any:
    """Mixtral converts to GGUF architecture ``llama`` with experts (``expert_count``)."""
    import transformers as tf

    cfg = tf.MixtralConfig(
        vocab_size=VOCAB_N, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
        eos_token_id=VOCAB_N - 1,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    return _shake(tf.MixtralForCausalLM, cfg, seed=2)


def _checkpoint(model: Any, arch: str) -> dict[str, torch.Tensor]:
    """The state dict as the released checkpoints lay it out (see the module docstring)."""
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for name, buf in model.named_buffers():  # the PLE hash constants are buffers
        if "ple_embedding." in name:
            sd.setdefault(name, buf.detach().clone())
    if arch == "qwen4exp":
        n_parts = model.config.split_ngram_parts
        for key in [k for k in sd if k.endswith("ngram_embedding.weight")]:
            table = sd.pop(key)
            stem = key.removesuffix(".weight")
            for i, part in enumerate(table.chunk(n_parts)):
                sd[f"{stem}.shard_{i}.weight"] = part.contiguous()
    else:  # an MTP block: layer 3 (full attention) copied under mtp.layers.0, plus fc and norms
        d = model.config.hidden_size
        g = torch.Generator().manual_seed(7)
        for key in [k for k in sd if k.startswith("model.layers.3.")]:
            sd["mtp.layers.0." + key.removeprefix("model.layers.3.")] = sd[key].clone()
        sd["mtp.fc.weight"] = torch.randn(d, 2 * d, generator=g) * 0.1
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            sd[f"mtp.{n}.weight"] = torch.randn(d, generator=g) * 0.1
    return sd


def _vocab(pre: str) -> dict[str, Any]:
    from mgserve.core.synth.vocab import SynthVocab

    vocab = SynthVocab(VOCAB_N, pre, endoftext_id=VOCAB_N - 3, im_start_id=VOCAB_N - 2,
                       im_end_id=VOCAB_N - 1)  # fmt: skip
    md = vocab.metadata()
    return {k.removeprefix("tokenizer."): v for k, (v, _) in md.items()}


# The child process: llama.cpp's converter, with only set_vocab replaced.
_CONVERT = r"""
import json, sys
from pathlib import Path
sdist = Path(sys.argv[1]); ckpt = Path(sys.argv[2]); out = Path(sys.argv[3])
sys.path[:0] = [str(sdist / "gguf-py"), str(sdist)]
import gguf
import torch
from conversion import ModelBase, get_model_class

vocab = json.loads((ckpt / "vocab.json").read_text())
hparams = ModelBase.load_hparams(ckpt, False)
base = get_model_class(hparams["architectures"][0])

class Converter(base):
    model_arch = base.model_arch

    def set_vocab(self):
        w = self.gguf_writer
        w.add_tokenizer_model(vocab["ggml.model"])
        w.add_tokenizer_pre(vocab["ggml.pre"])
        w.add_token_list(vocab["ggml.tokens"])
        w.add_token_types(vocab["ggml.token_type"])
        w.add_token_merges(vocab["ggml.merges"])
        w.add_eos_token_id(vocab["ggml.eos_token_id"])
        w.add_pad_token_id(vocab["ggml.padding_token_id"])
        w.add_bos_token_id(vocab["ggml.bos_token_id"])
        w.add_add_bos_token(vocab["ggml.add_bos_token"])
        w.add_chat_template(vocab["chat_template"])

with torch.inference_mode():
    m = Converter(ckpt, gguf.LlamaFileType.ALL_F32, out, model_name=f"tiny {ckpt.name}")
    m.write()
print(f"converted {ckpt.name} with {base.__name__}")
"""


def convert(model: Any, arch: str, pre: str, out: Path, tmp: Path) -> Path:
    from safetensors.torch import save_file

    ckpt = tmp / arch
    if arch == "llama":  # transformers saves Mixtral's experts one by one, as released
        model.save_pretrained(ckpt)
    else:
        ckpt.mkdir()
        (ckpt / "config.json").write_text(model.config.to_json_string())
        save_file(_checkpoint(model, arch), str(ckpt / "model.safetensors"))
    (ckpt / "vocab.json").write_text(json.dumps(_vocab(pre)))
    llama_cpp_dir = SDIST / "vendor" / "llama.cpp"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the sdist's gguf-py only
    subprocess.run(
        [sys.executable, "-c", _CONVERT, str(llama_cpp_dir), str(ckpt), str(out)],
        check=True, env=env, cwd=tmp,
    )  # fmt: skip
    return out


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from tests.data.make_hybrid_reference import record, run

    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, VOCAB_N - 3, (N_PROMPT,), generator=g)
    prompt[24::25] = VOCAB_N - 1  # an EOS now and then (PLE's n-gram reset)
    data: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch, make, pre in (
            ("qwen4exp", qwen4exp_model, "qwen35"),
            ("qwen3next", qwen3next_model, "qwen2"),
            ("llama", mixtral_model, "qwen2"),
        ):
            path = convert(make(), arch, pre, DATA / f"converted_{arch}.gguf", Path(tmp))
            tokens, logits = run(path, prompt.tolist(), n_gen=N_GEN, n_ctx=256)
            data[arch] = record(path, tokens, logits, N_PROMPT)
            kb = path.stat().st_size // 1024
            print(f"{arch}: {path.name} {kb} KiB, continuation {tokens[N_PROMPT:]}")
    OUT.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
