"""The one way to an engine: settings -> GGUF file, model, runner and ``Engine``.

The API asks here and never imports ``mgserve.cuda``; this module does, lazily, and loads the device
model and runner only when ``--device`` resolves to a GPU. What the settings leave to the model
(``ctx_size`` 0: its trained context) is made concrete before anything is sized from it.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from mgserve.config import Settings
from mgserve.core.builtin_models import resolve_model
from mgserve.core.engine.actor import Engine
from mgserve.core.engine.drafting import GreedyOnly
from mgserve.core.gguf.reader import GGUFFile
from mgserve.machine import choose_gpu
from mgserve.settings_checks import with_batch
from mgserve.spec import speculator_from

log = logging.getLogger(__name__)


class LoadedEngine(NamedTuple):
    engine: Engine  # its settings are resolved for the model; its model has the spec
    gguf: GGUFFile  # the model's file: tokenizer, chat template and path come from it
    device: str  # "cpu" or "cuda"


def load_engine(settings: Settings) -> LoadedEngine:
    """Load the GGUF (a built-in model when none is given) and build its engine on the device the
    settings ask for; ValueError when that cannot be (no GPU, a missing built-in, a bad file)."""
    from mgserve.core.models import load_model
    from mgserve.cuda import resolve_device
    from mgserve.pipeline.rendezvous import local_gpu, rendezvous

    if settings.virtual_stages > 1 and settings.prefill_lane == "on":  # two threads' steps at once
        raise ValueError("--virtual-stages does not run with --prefill-lane on yet")
    rv = rendezvous(settings)  # several processes: this one is rank 0 (cli.py runs the others)
    if settings.device != "cpu":
        if rv is not None:
            local_gpu(rv)  # torchrun's LOCAL_RANK names the GPU
        choose_gpu()  # several GPUs, none named: the freest becomes GPU 0 (before CUDA starts)
    device = resolve_device(settings.device)  # "cpu" or "cuda"; ValueError says why not cuda
    g = GGUFFile(resolve_model(settings.model, settings.cache_dir))
    if rv is not None:  # a layer pipeline across processes, on the device runner
        from mgserve.pipeline.lockstep import leader_engine

        return LoadedEngine(leader_engine(g, settings, device, rv), g, device)
    if device == "cuda":
        return _on_gpu(g, settings)
    if settings.virtual_stages > 1:
        raise ValueError("--virtual-stages is for the GPU runner (--device cuda)")
    if settings.activations == "int8":
        raise ValueError("--activations int8 is for the GPU runner (--device cuda)")
    model = load_model(g, threads=settings.threads)
    if settings.prefill_lane == "on":
        log.info("--prefill-lane on is for the GPU: the CPU runner computes steps in order")
    settings = with_batch(settings.for_model(model.spec.n_ctx_train), gpu=False)
    drafter = speculator_from(settings)  # greedy requests only on the CPU (drafting.GreedyOnly)
    engine = Engine(model, settings, drafter=GreedyOnly(drafter) if drafter else None)
    return LoadedEngine(engine, g, device)


def prefill_lane(settings: Settings) -> bool:
    """Whether a one-process GPU server runs the prefill lane: ``on``, or ``auto`` with several
    slots (a lone session has nothing to decode beside its prompt), one stage and no latency
    target (the lane's whole chunks leave the pacer nothing to do). The lane keeps decoders
    going through a long prompt: on an H100, two decoders' p99 gap beside a 32k prompt went from
    92x to 5.7x their solo gap at 87% of the solo prefill rate (BENCHMARKS.md, mixed load)."""
    if settings.prefill_lane != "auto":
        return settings.prefill_lane == "on"
    return settings.parallel > 1 and settings.virtual_stages == 1 and not settings.itl_target_ms


def memory_plan(g: GGUFFile, settings: Settings, check: bool) -> str:
    """The GPU memory plan of serving ``g`` with ``settings`` (resolved for the model): its
    table, checked against GPU 0's free memory or ``--gpu-memory`` (``check``; ValueError naming
    what to lower when it does not fit), or its summary lines."""
    from mgserve.cuda.plan_fit import checked_plan, gpu_batch, summary

    return checked_plan(g, gpu_batch(g, settings)) if check else summary(g, settings)


def _on_gpu(g: GGUFFile, settings: Settings) -> LoadedEngine:
    """The device model on GPU 0 behind a ``DeviceRunner``. Its pools are sized at load, so the
    context comes from the file's hyperparameters first."""
    import torch

    from mgserve import env
    from mgserve.core.gguf.hparams import spec_from_gguf
    from mgserve.core.gguf.hparams_hybrid import HYBRID_ARCHS, hybrid_spec_from_gguf
    from mgserve.cuda.backend import cuda_backend, int8_activations, load_device_model
    from mgserve.cuda.plan_fit import gpu_batch
    from mgserve.cuda.runner import DeviceRunner
    from mgserve.cuda.warmup import warm_up

    spec = hybrid_spec_from_gguf(g)[0] if g.architecture in HYBRID_ARCHS else spec_from_gguf(g)
    settings = gpu_batch(g, settings.for_model(spec.n_ctx_train))  # --batch-size 0: fitted
    log.info("%s", memory_plan(g, settings, check=True))  # refuses a plan that does not fit
    device = torch.device("cuda", 0)
    int8 = int8_activations(g, settings.activations)
    log.info("decode products: %s activations (--activations %s)",
             "int8" if int8 else "fp32", settings.activations)  # fmt: skip
    model = load_device_model(
        g,
        cuda_backend(0, int8=int8, cache_dir=env.cache_dir(settings.cache_dir)),  # cubins
        device,
        settings.parallel,
        settings.ctx_size,
        settings.cache_type_k,
        settings.cache_type_v,
    )
    lanes = prefill_lane(settings)
    n_stages = settings.virtual_stages
    run_model = model
    if n_stages > 1:  # the layer pipeline on this GPU (pipeline/staged.py)
        from mgserve.pipeline.staged import balanced_ranges, virtual_stages

        ranges = balanced_ranges(g, n_stages, settings.cache_type_k, settings.cache_type_v)
        run_model = virtual_stages(model, ranges, device, settings.pipeline_micro_batches)
    runner = DeviceRunner(run_model, device, lanes=lanes, lane_sms=settings.prefill_lane_sms)
    spec_k = settings.spec_k if settings.spec == "on" else 0
    warm_up(runner, model.spec.n_vocab, settings.ctx_size, settings.batch_size, spec_k)
    engine = Engine(model, settings, runner=runner, drafter=speculator_from(settings))
    if settings.spec == "on" and not runner.supports_drafts:
        log.info("--spec: the GPU runner does not verify drafts for %s yet", g.architecture)
    return LoadedEngine(engine, g, "cuda")
