"""``mgserve serve | info | synth | bench | kernels``: the command line. Settings:
``mgserve/config.py``."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys

from mgserve import config


def _parser(serve_only: bool = False) -> argparse.ArgumentParser:
    """The command line; ``serve_only``: just ``serve`` (the other commands' options import torch
    and the benchmarks, seconds that would pass before the server's port opens)."""
    p = argparse.ArgumentParser(
        prog="mgserve",
        description="Serve GGUF language models over HTTP (OpenAI- and llama-server-compatible).",
    )
    sub = p.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a GGUF model over HTTP")
    config.add_arguments(serve)
    if serve_only:
        return p

    info = sub.add_parser(
        "info", help="describe a GGUF file and plan the GPU memory serving it takes"
    )
    info.add_argument("file", nargs="?", help="the GGUF file (default: --model)")
    info.add_argument(
        "--plan",
        action="store_true",
        help="print the memory plan of `mgserve serve` with these options, item by item, and "
        "check it against the GPU's free memory (or --gpu-memory); with several GPUs "
        "(--device-list, or a --gpu-memory size per GPU) the stage plan of the layer pipeline",
    )
    config.add_arguments(info)

    from mgserve.core.synth import write as synth

    synth_p = sub.add_parser("synth", help="write a random-weight GGUF at a real model's shapes")
    synth.add_arguments(synth_p)

    bench = sub.add_parser("bench", help="run a benchmark (see BENCHMARKS.md)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    from mgserve.bench import BENCHMARKS

    for name in BENCHMARKS:
        mod = importlib.import_module(f"mgserve.bench.{name.replace('-', '_')}")
        bp = bsub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0])
        bp.add_argument("--record", action="store_true", help="append the result to BENCHMARKS.md")
        mod.add_arguments(bp)

    kernels = sub.add_parser("kernels", help="the CUDA kernels, without a GPU")
    ksub = kernels.add_subparsers(dest="kernels", required=True)
    from mgserve.cuda import offline

    check = ksub.add_parser(
        "check",
        help="compile every kernel variant with NVRTC (no GPU needed): registers, spills, "
        "shared memory per kernel; exit 1 if one fails to compile (needs the extra `kernels`)",
    )
    offline.add_arguments(check)
    from mgserve.cuda import prebuild

    build = ksub.add_parser(
        "build",
        help="compile every kernel variant into the server's kernel cache ahead of its first "
        "start on a GPU (no GPU needed; needs the extra `kernels`)",
    )
    prebuild.add_arguments(build)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser(serve_only=argv[:1] == ["serve"]).parse_args(argv)
    try:
        if args.command == "serve":
            from mgserve.api.server import serve
            from mgserve.devices import refuse_several
            from mgserve.pipeline.launch import launch, local_ranks
            from mgserve.pipeline.rendezvous import rendezvous

            settings = config.settings_from(args)
            ranks = local_ranks(settings)  # a pipeline of this host's processes, started here
            if ranks is not None:
                from mgserve.pipeline.lockstep import refuse

                refuse(dataclasses.replace(settings, device_list=None))  # before any rank starts
                settings = launch(settings, ranks)
            rv = rendezvous(settings)  # a pipeline across processes: ranks > 0 follow rank 0
            split = settings.tensor_split if rv is None else None  # across them: a rank's share
            refuse_several(settings.device_list, split, settings.gpu_memory)
            if rv is not None and rv.rank > 0:
                from mgserve.pipeline.lockstep import follow

                return follow(settings, rv)
            return serve(settings)
        if args.command == "info":
            from mgserve.pipeline.report import info_main

            return info_main(args)
        if args.command == "synth":
            from mgserve.core.synth import write as synth

            return synth.run(args)
        if args.command == "kernels":
            from mgserve.cuda import offline, prebuild

            return prebuild.run(args) if args.kernels == "build" else offline.run(args)
        mod = importlib.import_module(f"mgserve.bench.{args.bench.replace('-', '_')}")
        return int(mod.run(args))
    except ValueError as e:  # user errors (bad settings, bad GGUF) get one clear line, no trace
        print(f"mgserve: error: {e}", file=sys.stderr)
        return 2
