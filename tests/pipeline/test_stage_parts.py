"""A device model built for one stage of a pipeline (``load_device_model(..., part=Part(...))``,
what each process of ``serve`` across processes loads): only its layers and their pools, the token
table on the first stage and the head on the last (the tied embedding's quantized blocks there
too), and a clear error for a part it does not have. The stages together run the one-stage
forward bitwise: tests/cuda/test_device_stages_dist.py, tests/pipeline/test_serve_dist.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.cuda.test_device_models import _export


@pytest.mark.parametrize("arch", ["qwen4exp", "gemma3"])
def test_a_stage_loads_its_layers_and_ends_only(arch: str, tmp_path: Path) -> None:
    from mgserve.core.gguf.reader import GGUFFile
    from mgserve.cuda.backend import load_device_model, torch_backend
    from mgserve.cuda.models.base import Step
    from mgserve.cuda.plan_sizes import Part

    g = GGUFFile(_export(arch, tmp_path))
    cpu = torch.device("cpu")

    def load(part: Part | None):  # type: ignore[no-untyped-def]
        return load_device_model(g, torch_backend(), cpu, 2, 32, part=part)

    whole = load(None)
    n = whole.spec.n_layer
    k = n // 2
    first, last = load(Part(0, k, True, False)), load(Part(k, n, False, True))
    assert sorted(first.layers) == list(range(k)) and sorted(last.layers) == list(range(k, n))
    assert set(first.pools.k) | set(first.pools.conv) <= set(range(k))
    assert set(last.pools.k) | set(last.pools.conv) <= set(range(k, n))
    assert set(first.pools.k) | set(last.pools.k) == set(whole.pools.k)
    assert first.tok_embd is not None and first.output is None
    assert last.tok_embd is None and last.output is not None
    tied = whole.spec.tied_output  # the last stage keeps the embedding's blocks as its head
    assert first.weight_bytes + last.weight_bytes == whole.weight_bytes + (
        whole.output.nbytes if tied else 0
    )
    step = Step(tokens=torch.tensor([5]), pos=torch.tensor([0], dtype=torch.int32),
                slots=torch.tensor([0], dtype=torch.int32), decode=False)  # fmt: skip
    with pytest.raises(RuntimeError, match="token embedding is not loaded in this pipeline stage"):
        last.stage_in(step)
    x = first.stage_in(step)
    with pytest.raises(RuntimeError, match="head is not loaded in this pipeline stage"):
        first.stage_out(x, step)
