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
- the allocator: ``torch.cuda.memory_allocated`` counts the caching allocator's blocks, which
  exceed the requests (512-byte rounding; a large block split only when more than 1 MiB would
  remain): the load traced on the meta device and replayed through a model of it
  (plan_trace.py, plan_alloc.py; 0.4% of an 8-layer qwen4exp slice: issue 12);
- host memory besides: the PLE table (qwen4exp), memory-mapped and read row by row.

A ``Part`` narrows the plan to a range of layers and the model's ends (the token embedding on the
first stage, the output head and the sampler on the last): the memory of one stage of a layer
pipeline (mgserve/pipeline/stages.py); the whole model is one part.
"""

from __future__ import annotations

from typing import NamedTuple

from mgserve.config import Settings
from mgserve.cuda.plan_sizes import PLE_TABLE, ModelSizes, Part, kv_bytes
from mgserve.cuda.plan_trace import allocator_bytes
from mgserve.settings_checks import with_batch

__all__ = ["PLE_TABLE", "Item", "ModelSizes", "Part", "device_total", "human", "kv_bytes", "plan"]


class Item(NamedTuple):
    name: str
    nbytes: int
    detail: str
    host: bool = False  # in host memory, not the GPU's


def plan(sizes: ModelSizes, settings: Settings, part: Part | None = None) -> list[Item]:
    """The plan's items for ``settings`` (resolved for the model: ``Settings.for_model``; an
    automatic ``--batch-size`` as a GPU takes it unfitted), of the whole model or of one
    ``part`` (a pipeline stage: its layers, the ends it holds)."""
    s, spec = with_batch(settings, gpu=True), sizes.spec
    pt = part or Part.whole(spec.n_layer)
    n_ctx, n_slots, pools = s.ctx_size, s.parallel, s.parallel + 1
    types = f"K {s.cache_type_k}, V {s.cache_type_v}"
    kv = sizes.kv(n_ctx, s.cache_type_k, s.cache_type_v, pt)
    weights = sum(sizes.layer_weights[pt.start : pt.stop]) + (sizes.tail if pt.last else 0)
    items = [Item("weights", weights, "matrices in GGUF blocks, vectors float32")]
    if pt.last:
        tied = "the token embedding's blocks (tied)" if spec.tied_output else "GGUF blocks"
        items.append(Item("output head", sizes.head, tied))
    if pt.first:
        items.append(
            Item("token embedding", sizes.embedding, f"float32 [{spec.n_vocab}, {spec.n_embd}]")
        )
    if kv:
        items.append(
            Item(
                "KV cache", kv * pools, f"{human(kv)} per slot ({types}, {n_ctx} tokens) x {pools}"
            )
        )
    blocks = sizes.blocks(n_ctx, pt)
    if blocks:
        items.append(Item("QSA block keys", blocks * pools, f"{human(blocks)} per slot x {pools}"))
    rec = sizes.state(pt)
    if rec:
        items.append(Item("recurrent state", rec * pools, f"{human(rec)} per slot x {pools}"))
    slack = allocator_bytes(sizes, s, pt)  # memory_allocated counts blocks, not requests
    if slack:
        detail = "the caching allocator's blocks beyond the requests (512 B rounding, whole blocks)"
        items.append(Item("allocator", slack, detail))
    if not sizes.rewindable and s.ctx_checkpoints and rec:
        n = n_slots * s.ctx_checkpoints
        items.append(
            Item("device checkpoints", n * rec, f"{s.ctx_checkpoints} per slot x {n_slots} slots")
        )
        on_host = (s.cache_ram << 20) // sizes.recurrent  # a checkpoint is every stage's part
        detail = f"at most {on_host} in --cache-ram {s.cache_ram} MiB"
        items.append(Item("host checkpoints", on_host * rec, detail, True))
    work = sizes.workspace(n_ctx, n_slots, s.batch_size, pt)
    items.append(Item("workspace", work, f"estimate: {s.batch_size}-token prompt chunk, decode"))
    if sizes.ple_table and (sizes.qp is None or sizes.qp.ple is None or sizes.qp.ple.layer in pt):
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
