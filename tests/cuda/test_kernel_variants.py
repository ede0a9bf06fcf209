"""The offline inventory of kernel variants (mgserve/cuda/kernel_variants.py) against the code that
requests kernels, and the offline checker's pure parts (no NVRTC needed): every ``.kernel(``
call site in mgserve is one this inventory knows, its source is compiled offline (with no
defines where the site passes none), every kernel file is compiled, and a failure's log lines
map back to the file and line they came from."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from mgserve.cuda import compiler, offline
from mgserve.cuda.kernel_variants import variants

PKG = Path(compiler.__file__).resolve().parent.parent
KERNELS = sorted(p.name for p in compiler.KERNEL_DIR.glob("*.cu"))

# (module, source, defines) of each Kernels.kernel call. A new or changed call site fails
# test_every_call_site_is_known: cover its define sets in kernel_variants.py, then add it here.
KNOWN_SITES = {
    ("cuda/ops/act.py", "ACT_SOURCE", ""),
    ("cuda/ops/attention_cuda.py", "ATTN_SOURCE", "defines"),  # decode_defines
    ("cuda/ops/attention_prefill.py", "PREFILL_SOURCE", "flash_defines(d, k_q8, v_q8)"),
    ("cuda/ops/deltanet_cuda.py", "DELTANET_SOURCE", "conv_defines(k, vec)"),
    ("cuda/ops/deltanet_cuda.py", "DELTANET_SOURCE", "step_defines(head_dim)"),
    ("cuda/ops/deltanet_cuda.py", "DELTANET_SOURCE", ""),
    ("cuda/ops/deltanet_prefill_cuda.py", "PREFILL_SOURCE", "base"),  # prefill_defines
    ("cuda/ops/deltanet_prefill_cuda.py", "PREFILL_SOURCE", "defines"),  # (its scan_cols)
    ("cuda/ops/deltanet_prefill_cuda.py", "SCAN_TC_SOURCE", "tc"),  # scan_tc_defines
    ("cuda/ops/embed.py", "EMBED_SOURCE", ""),
    ("cuda/ops/hc_prompt.py", "HC_SOURCE", "ops.tuning.defines('BF16')"),
    ("cuda/ops/hc_cuda.py", "HC_SOURCE", "tune.defines(up.type_name)"),
    ("cuda/ops/hc_cuda.py", "HC_SOURCE", "tune.defines(wa.type_name)"),
    ("cuda/ops/hc_cluster.py", "HC_SOURCE", "tune.defines(wa.type_name, clustered=True)"),
    ("cuda/ops/hc_cluster.py", "HC_SOURCE", "tune.defines(up.type_name, clustered=True)"),
    ("cuda/ops/hgemm.py", "HGEMM_SOURCE", "t.defines()"),
    ("cuda/ops/hgemm.py", "HGEMM_WG_SOURCE", "t.defines()"),
    ("cuda/ops/qgemm.py", "QGEMM_WG_SOURCE", "t.defines(type_name)"),
    ("cuda/ops/kv.py", "UTIL_SOURCE", ""),
    ("cuda/ops/linear_cuda.py", "MATVEC_SOURCE", "self.tuning.defines()"),
    ("cuda/ops/linear_cuda.py", "DEQUANT_SOURCE", ""),
    ("cuda/ops/linear_q8.py", "Q8_SOURCE", "self.defines"),  # q8_defines
    ("cuda/ops/moe_cuda.py", "MOE_SOURCE", "self._defines"),  # moe_defines
    ("cuda/ops/moe_cuda.py", "MOE_Q8_SOURCE", "self._defines"),  # the down kernels
    ("cuda/ops/moe_cuda.py", "MOE_Q8_SOURCE", "defines"),  # gate/up: + Tickets.defines
    ("cuda/ops/moe_cuda.py", "SHARED_SOURCE", ""),
    ("cuda/ops/moe_prefill_cuda.py", "MOE_PREFILL_SOURCE", ""),
    ("cuda/ops/norm.py", "NORM_SOURCE", ""),
    ("cuda/ops/qgemm.py", "QGEMM_SOURCE", "tuning.defines(type_name)"),
    ("cuda/ops/qsa_cuda.py", "UTIL_SOURCE", ""),
    ("cuda/ops/qsa_cuda.py", "SELECT_SOURCE", ""),
    ("cuda/ops/qsa_prefill.py", "SELECT_SOURCE", ""),
    ("cuda/ops/attention_prefill.py", "SELECT_SOURCE", ""),
    ("cuda/ops/qsa_keys.py", "NORM_SOURCE", ""),
    ("cuda/ops/rope.py", "NORM_SOURCE", ""),
    ("cuda/ops/route.py", "ROUTE_SOURCE", ""),
    ("cuda/ops/route.py", "ROUTE_SOURCE", "defines"),  # matvec_route (matvec's or LEAN_*, tickets)
}


def call_sites() -> list[tuple[str, str, str, ast.expr]]:
    """(module, source, defines, kernel name) of every ``<...>kernels.kernel(...)`` call."""
    out = []
    for p in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr != "kernel" or not ast.unparse(node.func.value).endswith("kernels"):
                continue
            defines = node.args[2] if len(node.args) > 2 else None
            defines = defines or next((k.value for k in node.keywords if k.arg == "defines"), None)
            text = "" if defines is None else ast.unparse(defines)
            rel = p.relative_to(PKG).as_posix()
            out.append((rel, ast.unparse(node.args[0]), text, node.args[1]))
    return out


def site_source(module: str, expr: str) -> str:
    mod = importlib.import_module("mgserve." + module.removesuffix(".py").replace("/", "."))
    return str(getattr(mod, expr))


def test_every_call_site_is_known() -> None:
    sites = {(m, s, d) for m, s, d, _ in call_sites()}
    assert sites - KNOWN_SITES == set(), "call sites kernel_variants.py may not cover"
    assert KNOWN_SITES - sites == set(), "call sites that are gone: drop them from KNOWN_SITES"


def test_every_requested_source_is_compiled_offline() -> None:
    inventory = {(v.source, v.defines) for v in variants()}
    sources = {s for s, _ in inventory}
    for module, expr, defines, _ in call_sites():
        source = site_source(module, expr)
        assert source in sources, f"{module}: {source} is not in kernel_variants.py"
        if not defines:
            assert (source, ()) in inventory, f"{module}: {source} without defines"


def test_every_kernel_file_is_compiled_and_labels_are_unique() -> None:
    vs = variants()
    assert sorted({v.source for v in vs}) == KERNELS
    assert len({v.label for v in vs}) == len(vs)
    assert len({(v.source, v.defines) for v in vs}) == len(vs)


@pytest.mark.parametrize("name", KERNELS)
def test_origins_map_expanded_lines_back_to_their_files(name: str) -> None:
    expanded = compiler.expand_includes(compiler.KERNEL_DIR / name).splitlines()
    where = offline.origins(name)
    assert len(where) == len(expanded)
    files: dict[str, list[str]] = {}
    for text, origin in zip(expanded, where, strict=True):
        file, line = origin.rsplit(":", 1)
        lines = files.setdefault(file, (compiler.KERNEL_DIR / file).read_text().splitlines())
        original = lines[int(line) - 1]
        if offline._MARK.match(text) or (text == "" and original.startswith("#include")):
            assert original.startswith('#include "'), (origin, original)  # an inlined header
        else:
            assert original == text, origin


def test_nvrtc_options_are_cuda_core_s() -> None:
    """The options KernelCompiler._compile's ProgramOptions give NVRTC (where cuda.core is)."""
    core = pytest.importorskip("cuda.core")
    defines = (("QG_TYPE", "Q4_K"), ("QG_BM", "64"))
    popts = core.ProgramOptions(  # as KernelCompiler._compile builds them
        name="qgemm.cu", arch="sm_90", std="c++17", define_macro=[(k, v) for k, v in defines]
    )
    ours = offline.nvrtc_options(compiler.CompileOptions(arch="90", defines=defines))
    assert [o.encode() for o in ours] == popts.as_bytes("nvrtc")


PTXAS_LOG = """ptxas info    : 34084 bytes gmem
ptxas info    : Compiling entry function 'qgemm_down' for 'sm_90'
ptxas info    : Function properties for qgemm_down
ptxas         .     16 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 40960 bytes smem
ptxas info    : Compile time = 75.479 ms
ptxas info    : Compiling entry function 'qgemm_dequant' for 'sm_90'
ptxas info    : Function properties for qgemm_dequant
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 23 registers, used 0 barriers
ptxas info    : Function properties for __internal_trig_reduction_slowpathd
ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
"""


def test_ptxas_usage_is_parsed_per_kernel() -> None:
    down, dequant = offline.parse_usage(PTXAS_LOG)
    assert down == offline.KernelUsage("qgemm_down", 128, 16, 12, 8, 40960)
    assert down.spills
    assert dequant == offline.KernelUsage("qgemm_dequant", 23, 0, 4, 4)  # its callee's spills
