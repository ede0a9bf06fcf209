"""The Service: everything the HTTP layer serves from, built once at start-up."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

from mgserve.api.chat_output.formats import ChatFormat, detect_format
from mgserve.api.drain import Drain
from mgserve.api.textwork import TextPool
from mgserve.config import Settings
from mgserve.core.text.chat import ChatTemplate, load_chat_template

if TYPE_CHECKING:
    from mgserve.core.engine.actor import Engine
    from mgserve.core.engine.slot_store import SlotStore
    from mgserve.core.grammar import GrammarCompiler
    from mgserve.core.text.tokenizer import Tokenizer

log = logging.getLogger("mgserve.api")


class Detokenizer(Protocol):
    """Token ids in, UTF-8-safe text out (a partial character is held until it completes)."""

    def push(self, token: int) -> str: ...
    def flush(self) -> str: ...


@dataclass
class Service:
    settings: Settings  # resolved for the model (Settings.for_model): ctx_size is the engine's
    model_id: str  # alias or GGUF file name: what /v1/models and responses report
    tokenizer: Tokenizer
    chat: ChatTemplate
    engine: Engine
    n_ctx_train: int
    n_vocab: int
    architecture: str
    model_path: str = ""
    # a fresh incremental detokenizer per request, given the special tokens it keeps as text;
    # injectable so tests can run on fakes
    new_detokenizer: Callable[[frozenset[int]], Detokenizer] | None = None
    # the most bytes of text one token covers (its longest piece, at least one character): a
    # text longer than n_ctx times this cannot fit the context, whatever its tokens
    max_token_bytes: int = 0  # 0: measured from the vocabulary
    text: TextPool = field(default_factory=TextPool)  # rendering and tokenizing, off the loop
    slot_store: SlotStore | None = None  # --slot-save-path: slot save / restore / erase
    drain: Drain = field(default_factory=Drain)  # generations in flight; shutdown refuses new ones

    def __post_init__(self) -> None:
        if self.max_token_bytes == 0:
            longest = max(len(self.tokenizer.piece(t)) for t in range(self.n_vocab))
            self.max_token_bytes = max(4, longest)  # 4: an unknown character is one token

    @cached_property
    def chat_format(self) -> ChatFormat:
        """The tool-call and reasoning syntax the chat template implies."""
        return detect_format(self.chat.source)

    @cached_property
    def grammars(self) -> GrammarCompiler:
        """Structured output's grammars for this vocabulary (built on first use)."""
        from mgserve.core.grammar import GrammarCompiler

        return GrammarCompiler(self.tokenizer, self.n_vocab)

    def detokenizer(self, keep: frozenset[int] = frozenset()) -> Detokenizer:
        """Special tokens are dropped, except ``keep`` (markers the chat-output parser reads)."""
        if self.new_detokenizer is not None:
            return self.new_detokenizer(keep)
        from mgserve.core.text.tokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(self.tokenizer, skip_special=True, keep=keep)  # type: ignore[no-any-return]


def _special_text(tok: Any, token: int | None) -> str:
    if token is None or token < 0:
        return ""
    return str(tok.token_text(token))


def build_service(settings: Settings) -> Service:
    """The engine from the factory (model, runner, resolved settings), then the tokenizer and the
    chat template from the same GGUF."""
    from mgserve.core.engine.factory import load_engine
    from mgserve.core.engine.slot_file import model_fingerprint
    from mgserve.core.engine.slot_store import SlotStore
    from mgserve.core.text.tokenizer import Tokenizer

    engine, gguf_file, device = load_engine(settings)
    settings, spec = engine.settings, engine.model.spec
    tokenizer = Tokenizer.from_metadata(gguf_file.metadata)
    chat = load_chat_template(
        settings.chat_template,
        gguf_file.metadata.get("tokenizer.chat_template"),
        spec.arch,
        bos_token=_special_text(tokenizer, tokenizer.bos_id),
        eos_token=_special_text(tokenizer, tokenizer.eos_id),
        has_token=lambda text: tokenizer.token_id(text) is not None,
    )
    log.info(
        "model %s (%s) on %s, chat template %s, %d slots x %d tokens",
        gguf_file.path,
        spec.arch,
        device,
        chat.name,
        settings.parallel,
        settings.ctx_size,
    )
    return Service(
        settings=settings,
        model_id=settings.model_alias or gguf_file.path.name,
        tokenizer=tokenizer,
        chat=chat,
        engine=engine,
        n_ctx_train=int(spec.n_ctx_train),
        n_vocab=int(spec.n_vocab),
        architecture=str(spec.arch),
        model_path=str(gguf_file.path),
        slot_store=(
            SlotStore(engine, settings.slot_save_path, model_fingerprint(gguf_file))
            if settings.slot_save_path
            else None
        ),
    )
