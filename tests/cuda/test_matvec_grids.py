"""kernels/gguf_grids.cuh is generated from gguf-py's tables by tools/gen_gguf_grids.py; this checks
the committed header is that script's output, that its tables hold gguf-py's grids, and the rule
the kernels use instead of a ksigns table. Runs on the CPU."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from mgserve.cuda.compiler import KERNEL_DIR, expand_includes
from mgserve.cuda.weights import FORMATS

ROOT = Path(__file__).resolve().parents[2]
NEW_TYPES = ["Q2_K", "Q3_K", "MXFP4", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S",
             "IQ1_M"]  # fmt: skip


def generator():
    spec = importlib.util.spec_from_file_location(
        "gen_gguf_grids", ROOT / "tools/gen_gguf_grids.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def table(text: str, name: str) -> list[int]:
    m = re.search(rf"{name}\[(\d+)\] = \{{(.*?)\}};", text, re.S)
    assert m is not None, f"no table {name}"
    words = [int(w.rstrip("ul"), 16) for w in re.findall(r"0x[0-9a-f]+u?l*", m.group(2))]
    assert len(words) == int(m.group(1))
    return words


def test_committed_header_is_the_generators_output() -> None:
    gen = generator()
    assert (KERNEL_DIR / "gguf_grids.cuh").read_text() == gen.render(), (
        "gguf_grids.cuh is stale: run python3 tools/gen_gguf_grids.py"
    )
    assert gen.main(["--check"]) == 0


def test_tables_hold_gguf_py_grids() -> None:
    text = (KERNEL_DIR / "gguf_grids.cuh").read_text()
    for name, cls in [
        ("iq2xxs_grid", quants.IQ2_XXS),
        ("iq2xs_grid", quants.IQ2_XS),
        ("iq2s_grid", quants.IQ2_S),
        ("iq3xxs_grid", quants.IQ3_XXS),
        ("iq3s_grid", quants.IQ3_S),
        ("iq1s_grid", quants.IQ1_S),
    ]:
        cls.init_grid()
        grid = cls.grid.reshape(cls.grid_shape)  # [entries, width] float levels
        words = np.array(table(text, name), dtype=np.uint64)
        shifts = (8 * np.arange(grid.shape[1])).astype(np.uint64)
        levels = ((words[:, None] >> shifts) & np.uint64(0xFF)).astype(np.uint8).view(np.int8)
        np.testing.assert_array_equal(levels.astype(np.float32), grid, err_msg=name)
    quants.IQ1_M.init_grid()
    np.testing.assert_array_equal(quants.IQ1_M.grid, quants.IQ1_S.grid)  # one table serves both
    lo = int(re.search(r"MXFP4_KVALUES_LO (0x[0-9a-f]+)", text).group(1), 16)  # type: ignore[union-attr]
    hi = int(re.search(r"MXFP4_KVALUES_HI (0x[0-9a-f]+)", text).group(1), 16)  # type: ignore[union-attr]
    packed = np.array([lo, hi], dtype="<u8").view(np.int8)
    np.testing.assert_array_equal(packed, quants.MXFP4.kvalues)


def test_ksigns_is_index_plus_parity_bit() -> None:
    """The kernels compute ksigns[i] as i | parity(i) << 7 (gguf_blocks_iq.cuh)."""
    ksigns = np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8)
    rule = [i | ((bin(i).count("1") & 1) << 7) for i in range(128)]
    np.testing.assert_array_equal(ksigns, rule)


def test_new_types_have_kernels_and_gguf_sizes() -> None:
    for name in NEW_TYPES:
        fmt = FORMATS[name]
        assert (fmt.block, fmt.nbytes) == GGML_QUANT_SIZES[GGMLQuantizationType[name]], name
    for source, entry in [
        ("matvec.cu", "MATVEC_TYPE({})"),
        ("dequant.cu", "DEQUANT_TYPE({})"),
        ("moe.cu", "MOE_ENTRIES({})"),
    ]:
        text = expand_includes(KERNEL_DIR / source)
        assert "iq2xxs_grid[256]" in text, f"{source} does not inline the grids"
        for name in FORMATS:
            assert entry.format(name) in text, f"{source}: no kernels for {name}"
