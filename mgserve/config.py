"""One typed settings table: every option is a CLI flag and an ``MGSERVE_<NAME>`` variable.

Precedence: command line > environment > default. Where llama-server has the same option we accept
its flag names too (``-m``, ``-c``, ``-np``, ``--cache-type-k`` ...), so users can switch without
relearning. Nothing else in mgserve reads ``os.environ`` for settings (see ``mgserve/env.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mgserve import env
from mgserve.settings_checks import CPU_BATCH, GPU_BATCHES, check_settings

# KV cache types, as llama.cpp names them (their storage: core/models/kvcache.py)
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0")
DEVICES = ("auto", "cpu", "cuda")


def _opt(default: Any, help: str, *flags: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "flags": flags, "choices": choices})


@dataclass(frozen=True)
class Settings:
    model: str | None = _opt(
        None,
        "GGUF file or built-in model name (smollm2-135m-instruct, gemma-3-270m); "
        "default: smollm2-135m-instruct",
        "-m",
        "--model",
    )
    model_alias: str | None = _opt(
        None, "model id reported by /v1/models (default: the file's name)", "-a", "--alias"
    )
    host: str = _opt("127.0.0.1", "address to listen on", "--host")
    port: int = _opt(8080, "port to listen on", "--port")
    ctx_size: int = _opt(
        4096, "context size per slot in tokens (0: the model's trained context)", "-c", "--ctx-size"
    )
    parallel: int = _opt(4, "number of slots (sessions served at once)", "-np", "--parallel")
    batch_size: int = _opt(
        0,
        "prompt tokens per step, shared by all slots; prompts are cut into chunks of this size "
        f"(0: {CPU_BATCH} on the CPU; on a GPU the first of {GPU_BATCHES} its memory plan holds)",
        *("-b", "--batch-size"),
    )
    checkpoint_every: int = _opt(
        8192,
        "recurrent (Gated DeltaNet) models: also checkpoint a slot's state every N prompt "
        "tokens, so a request sharing part of a long prompt starts from the nearest one "
        "(0 or -1: only at the last chunk end before each prompt's end)",
        "--checkpoint-every",
        "-cpent",
        "--checkpoint-every-n-tokens",
    )
    ctx_checkpoints: int = _opt(
        8,
        "recurrent models: checkpoints kept per slot in device memory, the least recently used "
        "moved to host memory (0: none; a slot is then reused only when its whole history "
        "starts the prompt)",
        "--ctx-checkpoints",
        "-ctxcp",
    )
    cache_ram: int = _opt(
        8192,
        "MiB of host memory for checkpoints moved out of device memory, all slots together; "
        "the least recently used are dropped (0: none)",
        "--cache-ram",
        "-cram",
    )
    prefix_copy_min: int = _opt(
        256,
        "a new request's slot takes a prompt prefix from another slot's cache (busy or idle: "
        "its K/V rows and, for recurrent models, a checkpoint or its state) when that reuses at "
        "least this many tokens more than the slot's own cache (0: off)",
        "--prefix-copy-min",
    )
    gpu_memory: str | None = _opt(
        None,
        "device memory the start-up memory plan may use, e.g. 24GiB, 80GB or 20000 (MiB), for "
        "every GPU or one per --device-list entry; default: what each GPU reports free",
        "--gpu-memory",
    )
    device_list: str | None = _opt(
        None, "GPUs to split the layers over, in pipeline order, a process each: CUDA ordinals "
        "(0,1,2) or all; default: one GPU", "--device-list",
    )  # fmt: skip
    tensor_split: str | None = _opt(
        None,
        "share of the layers per --device-list GPU (or pipeline process), e.g. 3,3,2,1,2,2 "
        "(llama.cpp's); default: balanced by each layer's decode bytes",
        "--tensor-split",
        "-ts",
    )
    activations: str = _opt(
        "auto",
        "GPU decode products on int8 activations (faster on large models, relative error "
        "~1e-3), exact fp32 ones, or auto: int8 for GGUF files of 1 GiB of tensors or more",
        "--activations",
        choices=("auto", "exact", "int8"),
    )
    virtual_stages: int = _opt(
        1,
        "on a GPU: run the model as N stages of a layer pipeline on that one GPU (layers split "
        "by decode weight bytes, a stream each, hand-offs copied through pinned host buffers), "
        "to test and measure the pipeline on one card; decode graphs span the stages",
        "--virtual-stages",
    )
    pipeline_micro_batches: int = _opt(
        1,
        "a layer pipeline's decode steps split their sessions into this many groups that follow "
        "one another through the stages, several stages computing at once (same tokens)",
        "--pipeline-micro-batches",
    )
    dist_world_size: int = _opt(
        0,
        "processes of a layer pipeline (torch.distributed), one stage each; rank 0 serves HTTP, "
        "the others follow its steps; with no rank, started here (0: torchrun's WORLD_SIZE)",
        "--dist-world-size",
    )
    dist_rank: int = _opt(
        -1, "this process's rank in the pipeline, 0 to world size - 1 (-1: torchrun's RANK)",
        "--dist-rank",
    )  # fmt: skip
    dist_init: str | None = _opt(
        None,
        "where the pipeline's processes meet: tcp://HOST:PORT (rank 0's host) or file:///shared "
        "(default: env://, torchrun's MASTER_ADDR and MASTER_PORT)",
        "--dist-init",
    )
    dist_backend: str = _opt(
        "auto", "torch.distributed backend (auto: nccl on GPUs, gloo on the CPU)",
        "--dist-backend", choices=("auto", "gloo", "nccl"),
    )  # fmt: skip
    itl_target_ms: int = _opt(
        0,
        "inter-token latency target in ms while sessions decode: each step's prompt tokens are "
        "chosen from measured step times so that decoders' steps take about this long (prompts "
        "are still cut at the same places, so results do not change; 0: off, a whole batch-size "
        "of prompt tokens per step)",
        "--itl-target-ms",
    )
    prefill_sessions: int = _opt(
        0,
        "sessions whose prompts may be computed in the same step (0: as many as --batch-size "
        "holds); prompt tokens go to the oldest request first, later prompts wait their turn",
        "--prefill-sessions",
    )
    prefill_lane: str = _opt(
        "auto",
        "on: on a GPU, prompt chunks run on a low-priority CUDA stream of their own beside the "
        "decoders' steps on a high-priority one, a chunk in flight across several decode steps "
        "(whole --batch-size chunks; --itl-target-ms then does nothing); the results do not "
        "change. off: a step computes its prompt chunk and then its decode tokens. auto: on "
        "for one GPU of one process serving several slots without --itl-target-ms, else off",
        "--prefill-lane",
        choices=("auto", "on", "off"),
    )
    prefill_lane_sms: int = _opt(
        0,
        "with the prefill lane: the prompt lane's kernels run on this many of the GPU's SMs (a "
        "CUDA green context), so decode steps always find the others free; 0: no partition",
        "--prefill-lane-sms",
    )
    spec: str = _opt(
        "on",
        "n-gram speculation (output unchanged); its gates keep it off where it does not pay: "
        "more users than --spec-max-users, low acceptance, a verify measured too dear",
        "--spec",
        choices=("on", "off"),
    )
    spec_max_users: int = _opt(
        2, "draft only while at most N sessions generate", "--spec-max-users"
    )
    spec_k: int = _opt(16, "most drafts per step (0: no speculation)", "--spec-k", "--draft-max")
    spec_ngram_max: int = _opt(8, "longest suffix looked up for drafts", "--spec-ngram-max")
    spec_ngram_min: int = _opt(2, "shortest suffix looked up for drafts", "--spec-ngram-min")
    spec_min_acceptance: float = _opt(
        0.2, "below this running acceptance a session only probes", "--spec-min-acceptance"
    )
    slot_save_path: str | None = _opt(
        None,
        "directory of slot files: enables POST /slots/{id}?action=save|restore|erase "
        "(llama-server's; file names are confined to it)",
        "--slot-save-path",
    )
    max_queue: int = _opt(
        64,
        "requests that may wait for a slot; one more gets a 503 with Retry-After "
        "(0: refuse whatever finds no free slot)",
        "--max-queue",
    )
    api_key: str | None = _opt(
        None, "require 'Authorization: Bearer KEY' (not on /health)", "--api-key"
    )
    chat_template: str | None = _opt(
        None,
        "chat template: a built-in name (gemma, chatml, qwen2.5, qwen3, qwen3.5, llama3) or a "
        "jinja file; "
        "default: the GGUF's own, else the architecture's built-in",
        "--chat-template",
    )
    reasoning_format: str = _opt(
        "auto",
        "where a chat answer's reasoning goes: none (left in the content, tags and all), "
        "deepseek or auto (split out into reasoning_content); a request's reasoning_format "
        "overrides it",
        "--reasoning-format",
        choices=("none", "deepseek", "auto"),
    )
    reasoning_budget: int = _opt(
        -1,
        "tokens a chat answer's reasoning block may hold before the server closes it and the "
        "answer follows: -1 no limit, 0 no reasoning (the template's enable_thinking=false where "
        "it has one); a request's thinking_budget_tokens overrides it",
        "--reasoning-budget",
    )
    cache_type_k: str = _opt(
        "f16", "KV cache type for K", "-ctk", "--cache-type-k", choices=CACHE_TYPES
    )
    cache_type_v: str = _opt(
        "f16", "KV cache type for V", "-ctv", "--cache-type-v", choices=CACHE_TYPES
    )
    device: str = _opt("auto", "where the model runs", "--device", choices=DEVICES)
    threads: int = _opt(0, "CPU threads (0: the cores it may use)", "-t", "--threads")
    n_predict: int = _opt(
        -1,
        "default max tokens to generate when a request gives none (-1: to context end)",
        "-n",
        "--n-predict",
    )
    seed: int = _opt(-1, "default sampling seed (-1: random per request)", "-s", "--seed")
    max_body_mb: int = _opt(64, "largest accepted request body, in MiB", "--max-body-mb")
    log_level: str = _opt(
        "info", "logging level", "--log-level", choices=("debug", "info", "warning", "error")
    )
    cache_dir: str | None = _opt(
        None,
        "where compiled kernels and the assembled built-in model are kept "
        "(default: $XDG_CACHE_HOME/mgserve, else ~/.cache/mgserve)",
        "--cache-dir",
    )

    def __post_init__(self) -> None:
        check_settings(self)

    def for_model(self, n_ctx_train: int) -> Settings:
        """These settings for a model trained on ``n_ctx_train`` tokens: a ctx_size of 0 (the
        model's context) becomes that number. The engine factory calls it, once per engine."""
        return self if self.ctx_size else dataclasses.replace(self, ctx_size=n_ctx_train)


def _field_type(f: dataclasses.Field[Any]) -> type:
    t = str(f.type)
    return int if t.startswith("int") else float if t.startswith("float") else str


def env_name(name: str) -> str:
    return "MGSERVE_" + name.upper()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per setting. Defaults are None so we can tell 'not given' from 'given'."""
    for f in dataclasses.fields(Settings):
        md = f.metadata
        default = f.default
        parser.add_argument(
            *md["flags"],
            dest=f.name,
            type=_field_type(f),
            default=None,
            choices=md.get("choices"),
            help=f"{md['help']} [env {env_name(f.name)}; default {default!r}]",
        )


def settings_from(args: argparse.Namespace | None = None, **overrides: Any) -> Settings:
    """Build Settings from parsed CLI args, then MGSERVE_* variables, then defaults."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(Settings):
        cli = getattr(args, f.name, None) if args is not None else None
        if f.name in overrides:
            values[f.name] = overrides[f.name]
        elif cli is not None:
            values[f.name] = cli
        else:
            raw = env.get(env_name(f.name))
            if raw is not None:
                conv = _field_type(f)
                try:
                    values[f.name] = conv(raw)
                except ValueError:
                    what = f"{env_name(f.name)}={raw!r} is not a valid {conv.__name__}"
                    raise ValueError(what) from None
    return Settings(**values)
