from __future__ import annotations

import re
from pathlib import Path

import pytest

from mgserve.cli import main
from tests.core.tiny import export, hf_model


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export(hf_model("gemma3", tied=True), "gemma3", tmp_path_factory.mktemp("g") / "g.gguf")


def test_info_describes_file_and_kv_memory(tiny_gemma: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["info", str(tiny_gemma), "-c", "100", "-np", "3", "-ctk", "q8_0"]) == 0
    out = capsys.readouterr().out
    assert "architecture:  gemma3" in out
    assert "global: [5]" in out  # 7 layers, pattern 6
    assert re.search(r"tied_output\s+True", out)
    # all F32: token_embd + output_norm + 13 per layer: q, o (64x128), k, v (64x64), q/k norms (32),
    # gate, up, down (64x96), 4 norms (64)
    attn = 2 * 64 * 128 + 2 * 64 * 64
    n_bytes = 4 * (160 * 64 + 64 + 7 * (attn + 2 * 32 + 3 * 64 * 96 + 4 * 64))
    assert re.search(rf"F32\s+{2 + 7 * 13}\s+{n_bytes:,}\s", out)
    # 7 layers x 2 KV heads x 32 dims: K q8_0 (34/32 bytes) + V f16 (2 bytes) per value
    per_token = 7 * 64 * 34 // 32 + 7 * 64 * 2
    assert f"{per_token:,} bytes per token" in out
    assert f"100 tokens x 3 slot(s) = {per_token * 300:,} bytes" in out


def test_info_bad_file_is_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 10)
    assert main(["info", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mgserve: error: ") and str(bad) in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("arch", ["qwen3next", "qwen4exp"])
def test_info_of_hybrid_models_counts_their_session_state(
    arch: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import torch

    from mgserve.core.gguf.reader import GGUFFile
    from mgserve.cuda.backend import load_device_model, torch_backend
    from tests.core import hybrid_export, qwen4exp_export

    path = tmp_path / f"{arch}.gguf"
    if arch == "qwen3next":
        hybrid_export.export(hybrid_export.hf_model(arch), arch, path)
    else:
        qwen4exp_export.export(qwen4exp_export.hf_model(), path)
    assert main(["info", str(path), "-c", "256", "-np", "2"]) == 0
    out = capsys.readouterr().out
    assert f"architecture:  {arch}" in out and "-- MoE / DeltaNet" in out
    # what the device model allocates for a session of 256 tokens (its pools: 2 slots + spare)
    pools = load_device_model(GGUFFile(path), torch_backend(), torch.device("cpu"), 2, 256).pools
    session = pools.nbytes // pools.n_slots
    assert f"256 tokens x 2 slot(s) = {2 * session:,} bytes" in out
    assert re.search(r"recurrent state [\d,]+ bytes per slot", out)


def test_info_context_zero_is_the_models_and_bad_settings_are_the_servers_errors(
    tiny_gemma: Path, capsys: pytest.CaptureFixture
) -> None:
    """info takes the server's settings (flags, MGSERVE_* variables, defaults): -c 0 means the
    model's trained context, as for `mgserve serve`; out-of-range settings get the server's
    messages."""
    from mgserve.core.gguf.reader import GGUFFile

    n_train = GGUFFile(tiny_gemma).metadata["gemma3.context_length"]
    assert main(["info", str(tiny_gemma), "-c", "0"]) == 0
    assert f"{n_train:,} tokens x 4 slot(s)" in capsys.readouterr().out
    assert main(["info", str(tiny_gemma)]) == 0
    assert "4,096 tokens x 4 slot(s)" in capsys.readouterr().out
    assert main(["info", str(tiny_gemma), "-c", "-5"]) == 2
    assert "ctx-size must be >= 0" in capsys.readouterr().err
    assert main(["info", str(tiny_gemma), "-np", "0"]) == 2
    assert "parallel must be >= 1" in capsys.readouterr().err
