"""The Service: everything the HTTP layer serves from, built once at start-up."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from mgserve.api.textwork import TextPool
from mgserve.config import Settings
from mgserve.core.builtin_models import resolve_model
from mgserve.core.text.chat import ChatTemplate, load_chat_template
from mgserve.cuda import resolve_device

if TYPE_CHECKING:
    from mgserve.core.engine.actor import Engine
    from mgserve.core.text.tokenizer import Tokenizer

log = logging.getLogger("mgserve.api")


class Detokenizer(Protocol):
    """Token ids in, UTF-8-safe text out (a partial character is held until it completes)."""

    def push(self, token: int) -> str: ...
    def flush(self) -> str: ...


@dataclass
class Service:
    settings: Settings  # ctx_size already resolved (0 -> the model's trained context)
    model_id: str  # alias or GGUF file name: what /v1/models and responses report
    tokenizer: Tokenizer
    chat: ChatTemplate
    engine: Engine
    n_ctx_train: int
    n_vocab: int
    architecture: str
    model_path: str = ""
    # a fresh incremental detokenizer per request; injectable so tests can run on fakes
    new_detokenizer: Callable[[], Detokenizer] | None = None
    # the most bytes of text one token covers (its longest piece, at least one character): a
    # text longer than n_ctx times this cannot fit the context, whatever its tokens
    max_token_bytes: int = 0  # 0: measured from the vocabulary
    text: TextPool = field(default_factory=TextPool)  # rendering and tokenizing, off the loop

    def __post_init__(self) -> None:
        if self.max_token_bytes == 0:
            longest = max(len(self.tokenizer.piece(t)) for t in range(self.n_vocab))
            self.max_token_bytes = max(4, longest)  # 4: an unknown character is one token

    def detokenizer(self) -> Detokenizer:
        if self.new_detokenizer is not None:
            return self.new_detokenizer()
        from mgserve.core.text.tokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(self.tokenizer, skip_special=True)  # type: ignore[no-any-return]


def _special_text(tok: Any, token: int | None) -> str:
    if token is None or token < 0:
        return ""
    return str(tok.token_text(token))


def _device_model(g: Any, settings: Settings) -> tuple[Any, Any, Settings]:
    """The device model of ``g`` on GPU 0 with its runner, and the settings with ctx_size set
    (the pools are sized from it at load)."""
    import torch

    from mgserve.core.gguf.hparams import spec_from_gguf
    from mgserve.core.gguf.hparams_hybrid import hybrid_spec_from_gguf
    from mgserve.cuda.backend import HYBRID_ARCHS, cuda_backend, load_device_model
    from mgserve.cuda.runner import DeviceRunner

    if settings.ctx_size == 0:
        arch = g.architecture
        spec = hybrid_spec_from_gguf(g)[0] if arch in HYBRID_ARCHS else spec_from_gguf(g)
        settings = dataclasses.replace(settings, ctx_size=int(spec.n_ctx_train))
    device = torch.device("cuda", 0)
    model = load_device_model(
        g,
        cuda_backend(0),
        device,
        settings.parallel,
        settings.ctx_size,
        settings.cache_type_k,
        settings.cache_type_v,
    )
    return model, DeviceRunner(model, device), settings


def build_service(settings: Settings) -> Service:
    """Load the GGUF (a built-in model when none is given), model, tokenizer, template, engine."""
    from mgserve.core.engine.actor import Engine
    from mgserve.core.gguf.reader import GGUFFile
    from mgserve.core.models import load_model
    from mgserve.core.text.tokenizer import Tokenizer

    device = resolve_device(settings.device)  # "cpu" or "cuda"; ValueError says why not cuda
    path = str(resolve_model(settings.model, settings.cache_dir))
    gguf_file = GGUFFile(path)
    runner = None
    if device == "cuda":
        model, runner, settings = _device_model(gguf_file, settings)
    else:
        model = load_model(gguf_file, threads=settings.threads)
    spec = model.spec
    if settings.ctx_size == 0:
        settings = dataclasses.replace(settings, ctx_size=int(spec.n_ctx_train))
    tokenizer = Tokenizer.from_metadata(gguf_file.metadata)
    chat = load_chat_template(
        settings.chat_template,
        gguf_file.metadata.get("tokenizer.chat_template"),
        spec.arch,
        bos_token=_special_text(tokenizer, tokenizer.bos_id),
        eos_token=_special_text(tokenizer, tokenizer.eos_id),
        has_token=lambda text: tokenizer.token_id(text) is not None,
    )
    engine = Engine(model, settings, runner=runner)
    log.info(
        "model %s (%s) on %s, chat template %s, %d slots x %d tokens",
        path,
        spec.arch,
        device,
        chat.name,
        settings.parallel,
        settings.ctx_size,
    )
    return Service(
        settings=settings,
        model_id=settings.model_alias or Path(path).name,
        tokenizer=tokenizer,
        chat=chat,
        engine=engine,
        n_ctx_train=int(spec.n_ctx_train),
        n_vocab=int(spec.n_vocab),
        architecture=str(spec.arch),
        model_path=str(path),
    )
