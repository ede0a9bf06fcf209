"""Chained decode rows (ops/chains.py): every op that keeps a recurrent state gives, for a step
whose rows form runs (one slot's consecutive positions), bitwise the outputs and final state of
the same rows run one at a time through the single-row op, in order. DeltaNet conv and delta
rule (plain and with its gates), the PLE conv, QSA pending and block keys.

On the CPU with the torch backend (also with a graph's bound on the runs, ``longest`` = the row
count, above the longest run); with ``-m gpu`` the CUDA kernels against single-row launches of
themselves (and QSA's unfused path).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from mgserve.cuda.ops.chains import Chains, runs_of

# runs of 1, 5, 1 and 3 rows; slot 0's run crosses a QSA block end (ratio 4: 7) into the next
SLOTS = [2, 0, 0, 0, 0, 0, 3, 1, 1, 1]
POS = [9, 5, 6, 7, 8, 9, 7, 2, 3, 4]
N_SLOTS = 5

Op = Callable[[Any, list[int], Chains | None], torch.Tensor]  # (state, rows, chains) -> out


def _rand(device: torch.device, *shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device)


def _int(xs: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32, device=device)


def _same(make_state: Callable[[], Any], op: Op, device: torch.device, graph: bool) -> None:
    """``op`` on all rows chained == on each row alone, in order: outputs and states, bitwise."""
    alone = make_state()
    outs = [op(alone, [i], None) for i in range(len(SLOTS))]
    chained = make_state()
    chains = Chains.of(SLOTS, device)
    assert chains.longest == 5
    if graph:  # a graph's buffers: the host knows a bound on the runs, not the longest
        chains = dataclasses.replace(chains, longest=len(SLOTS))
    got = op(chained, list(range(len(SLOTS))), chains)
    for i, want in enumerate(outs):
        assert torch.equal(got[i : i + 1], want), f"row {i} differs"
    for i, (a, b) in enumerate(zip(alone, chained, strict=True)):
        assert torch.equal(a, b), f"state {i} differs: {(a - b).abs().max().item():.3g}"


def _deltanet(backend: Any, device: torch.device, graph: bool, gates: bool, d: int = 8) -> None:
    heads = {"n_k_heads": 2, "n_v_heads": 4, "head_dim": d, "eps": 1e-6}
    c = (2 * 2 + 4) * d
    x = _rand(device, len(SLOTS), c, seed=1)
    ba = _rand(device, len(SLOTS), 8, seed=2, scale=3.0)
    g = -torch.nn.functional.softplus(_rand(device, len(SLOTS), 4, seed=3))
    beta = torch.sigmoid(_rand(device, len(SLOTS), 4, seed=4))
    dt_bias, a = _rand(device, 4, seed=5), -_rand(device, 4, seed=6).abs()
    weight = _rand(device, c, 4, seed=7, scale=0.5)

    def state() -> tuple[torch.Tensor, torch.Tensor]:
        return _rand(device, N_SLOTS, 3, c, seed=8), _rand(device, N_SLOTS, 4, d, d, seed=9)

    def op(st: tuple[torch.Tensor, torch.Tensor], rows: list[int], ch: Chains | None):
        conv, ssm = st
        r = torch.tensor(rows, device=device)
        slots = _int([SLOTS[i] for i in rows], device)
        y = backend.deltanet.conv_step(x[r], conv, slots, weight, ch)
        if gates:
            b_, al = ba[r].split(4, dim=1)
            o = backend.deltanet.step_gates(y, b_, al, dt_bias, a, ssm, slots, **heads, chains=ch)
        else:
            o = backend.deltanet.step(y, g[r], beta[r], ssm, slots, **heads, chains=ch)
        return torch.cat((y, o.flatten(1)), dim=1)

    _same(state, op, device, graph)


def _ple(backend: Any, device: torch.device, graph: bool) -> None:
    x, weight = _rand(device, len(SLOTS), 12, seed=11), _rand(device, 12, 3, seed=12)

    def op(st: tuple[torch.Tensor], rows: list[int], ch: Chains | None) -> torch.Tensor:
        r, slots = torch.tensor(rows, device=device), _int([SLOTS[i] for i in rows], device)
        return backend.ple.conv_decode(x[r], st[0], slots, weight, 2, ch)  # dilation 2

    _same(lambda: (_rand(device, N_SLOTS, 4, 12, seed=13),), op, device, graph)


def _qsa_keys(backend: Any, device: torch.device, graph: bool, dim: int = 16) -> None:
    raw, k_norm = _rand(device, len(SLOTS), dim, seed=21), _rand(device, dim, seed=22) + 2.0
    rot = {"n_rot": 8, "base": 1e4, "scale": 1.0}

    def state() -> tuple[torch.Tensor, torch.Tensor]:
        return _rand(device, N_SLOTS, 4, dim, seed=23), _rand(device, N_SLOTS, 8, dim, seed=24)

    def op(st: tuple[torch.Tensor, torch.Tensor], rows: list[int], ch: Chains | None):
        r, slots = torch.tensor(rows, device=device), _int([SLOTS[i] for i in rows], device)
        pos = _int([POS[i] for i in rows], device)
        backend.qsa_keys.write_decode(raw[r], *st, slots, pos, k_norm, 1e-6, **rot, chains=ch)
        return raw[r]  # the op has no output: the states say it all

    _same(state, op, device, graph)


def test_runs_of() -> None:
    assert runs_of(SLOTS) == (
        [1, 5, 0, 0, 0, 0, 1, 3, 0, 0],
        [0, 0, 1, 2, 3, 4, 0, 0, 1, 2],
        [0, 5, 5, 5, 5, 5, 6, 9, 9, 9],
    )
    assert runs_of([]) == ([], [], [])


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("gates", [False, True])
def test_deltanet_torch(gates: bool, graph: bool) -> None:
    from mgserve.cuda.backend import torch_backend

    _deltanet(torch_backend(), torch.device("cpu"), graph, gates)


@pytest.mark.parametrize("graph", [False, True])
def test_ple_conv_torch(graph: bool) -> None:
    from mgserve.cuda.backend import torch_backend

    _ple(torch_backend(), torch.device("cpu"), graph)


@pytest.mark.parametrize("graph", [False, True])
def test_qsa_keys_torch(graph: bool) -> None:
    from mgserve.cuda.backend import torch_backend

    _qsa_keys(torch_backend(), torch.device("cpu"), graph)


@pytest.mark.gpu
@pytest.mark.parametrize("gates", [False, True])
def test_deltanet_kernels(cuda_ops, gates: bool) -> None:
    """conv_step_f32, delta_step_f32 / delta_step_gates_f32 over runs == single-row launches."""
    _deltanet(cuda_ops, torch.device("cuda", 0), True, gates)


@pytest.mark.gpu
def test_deltanet_kernels_head_dim_128(cuda_ops) -> None:
    """The target head dim (each warp owning 32 rows of the state column)."""
    _deltanet(cuda_ops, torch.device("cuda", 0), True, True, d=128)


@pytest.mark.gpu
def test_ple_conv_gpu(cuda_ops) -> None:
    _ple(cuda_ops, torch.device("cuda", 0), True)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [16, 30])
def test_qsa_keys_kernel(cuda_ops, dim: int) -> None:
    """qsa_keys_decode_f32 over runs == single-row launches (dim 30: the scalar norm path)."""
    _qsa_keys(cuda_ops, torch.device("cuda", 0), True, dim)


@pytest.mark.gpu
def test_qsa_keys_unfused_gpu(kernels) -> None:
    """The unfused decode path (torch gathers, norm and rope kernels) in a graph's form."""
    from mgserve.cuda.backend import cuda_backend

    _qsa_keys(cuda_backend(kernels=kernels, fused_decode=False), torch.device("cuda", 0), True)
