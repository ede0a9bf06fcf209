"""llama-server's /infill: the fill-in-the-middle prompt of a code model, from the text around the
cursor. The request (beside every /completion field):

- ``input_prefix`` / ``input_suffix`` (required): the code before / after the cursor, a string or
  llama-server's mix of token ids and strings; special-token text in them is plain text;
- ``prompt``: the start of the middle (the cursor line's text so far), special tokens parsed;
- ``input_extra``: other files, ``[{"filename", "text"}]`` (``time``, which llama.vim sends with
  each, says when the chunk was taken and changes nothing).

The prompt, as llama-server builds it (the repo-level pattern of the Qwen2.5-Coder report,
arXiv 2409.12186; without FIM_REP / FIM_SEP tokens each file is preceded by "--- snippet ---")::

    [FIM_REP]myproject\\n [FIM_SEP]{filename}\\n{text} ... [FIM_SEP]filename\\n     <- extra context
    [BOS] [FIM_PRE]{prefix}{prompt} [FIM_SUF]{suffix} [FIM_MID]

The middle is what the model generates. The FIM part fits one batch (``--batch-size``): the
prefix keeps its last 3/4 of a batch of tokens, the suffix its first quarter less the prompt and 2.
The extra context keeps its last tokens that fit what the context has left after the FIM part
(a batch at least, as llama-server reserves) and twice the answer's ``n_predict`` (the request's,
else ``--n-predict``; one token when neither bounds it). llama-server's sum can pass the context
(it then shifts it); ours never does when the FIM part itself fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mgserve.api.errors import ApiError
from mgserve.api.prompts import check_text_size, encode_text, mixed_prompt
from mgserve.api.protocol import GenParams
from mgserve.api.service import Service
from mgserve.core.text.roles import FimTokens

SNIPPET = "\n\n--- snippet ---\n\n"  # between extra files when the vocab has no FIM_SEP
REPO, FILE = "myproject", "filename"  # llama-server's names for the repository and this file
_CHUNK_KEYS = frozenset({"filename", "text", "time"})


@dataclass(frozen=True)
class InfillInputs:
    prefix: str | list[Any]
    suffix: str | list[Any]
    prompt: str
    extra: list[tuple[str, str]]  # (filename, text) per other file


def check_model(service: Service) -> FimTokens:
    """The vocab's FIM tokens; 400 when it lacks one an infill prompt needs."""
    fim = service.tokenizer.fim
    if missing := fim.missing():
        raise ApiError(
            "infill is not supported by this model: its vocabulary has no fill-in-the-middle "
            f"{', '.join(missing)} token{'s' if len(missing) > 1 else ''}"
        )
    return fim


def infill_inputs(body: dict[str, Any]) -> InfillInputs:
    """The request's infill fields, type-checked (the body's fields are read_body's)."""
    parts = []
    for name in ("input_prefix", "input_suffix"):
        value = body.get(name)
        if value is None:
            raise ApiError(f"'{name}' is required", param=name)
        if not isinstance(value, str | list):
            raise ApiError(
                f"'{name}' must be a string or a list of token ids and strings", param=name
            )
        parts.append(value)
    prompt = body.get("prompt")
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise ApiError("'prompt' must be a string", param="prompt")
    chunks = body.get("input_extra")
    if chunks is None:
        chunks = []
    if not isinstance(chunks, list):
        raise ApiError(
            '\'input_extra\' must be a list of {"filename": string, "text": string}',
            param="input_extra",
        )
    extra = []
    for i, chunk in enumerate(chunks):
        where = f"input_extra[{i}]"
        if not isinstance(chunk, dict):
            raise ApiError(f"{where} must be an object", param="input_extra")
        if unknown := sorted(set(chunk) - _CHUNK_KEYS):
            raise ApiError(
                f"{where}: '{unknown[0]}' is not supported (a file takes filename, text, time)",
                param="input_extra",
            )
        text, filename = chunk.get("text"), chunk.get("filename")
        if filename is None:
            filename = "tmp"  # llama-server's name for a file sent without one
        if not isinstance(text, str):
            raise ApiError(f"{where}.text must be a string", param="input_extra")
        if not isinstance(filename, str):
            raise ApiError(f"{where}.filename must be a string", param="input_extra")
        extra.append((filename, text))
    return InfillInputs(parts[0], parts[1], prompt, extra)


def _code(service: Service, value: str | list[Any], param: str) -> list[int]:
    """Prefix or suffix: no BOS, special-token text stays text (llama-server's tokenize_mixed)."""
    if isinstance(value, str):
        return encode_text(service, value, add_special=False, param=param, parse_special=False)
    return mixed_prompt(service, value, param, add_special=False, parse_special=False)


def extra_context(service: Service, fim: FimTokens, files: list[tuple[str, str]]) -> list[int]:
    """The other files' tokens, in the repo-level pattern when the vocab has its tokens."""

    def plain(text: str) -> list[int]:
        return service.tokenizer.encode(text, add_special=False, parse_special=False)

    out = [fim.rep, *plain(REPO + "\n")] if fim.rep is not None else []
    for filename, text in files:
        check_text_size(service, text, "input_extra")
        out += [fim.sep, *plain(filename + "\n")] if fim.sep is not None else plain(SNIPPET)
        out += plain(text)
    if fim.sep is not None:
        out += [fim.sep, *plain(FILE + "\n")]
    return out


def infill_prompt(
    service: Service, fim: FimTokens, inputs: InfillInputs, params: GenParams
) -> list[int]:
    """The request's FIM prompt (on the text pool: it tokenizes); ``fim``: check_model's."""
    tok = service.tokenizer
    prompt = encode_text(service, inputs.prompt, add_special=False)
    n_ctx = service.engine.n_ctx
    n_batch = min(service.settings.batch_size, n_ctx)
    answer = params.max_tokens or max(service.settings.n_predict, 0)
    return assemble(
        fim,
        tok.bos_id if tok.add_bos else None,
        _code(service, inputs.prefix, "input_prefix"),
        _code(service, inputs.suffix, "input_suffix"),
        prompt,
        extra_context(service, fim, inputs.extra),
        n_batch,
        n_ctx - (2 * answer if answer else 1),
    )


def assemble(
    fim: FimTokens,
    bos: int | None,
    prefix: list[int],
    suffix: list[int],
    prompt: list[int],
    extra: list[int],
    n_batch: int,
    room: int,
) -> list[int]:
    """The FIM prompt from its token parts, cut to the budget (module docstring); ``room``: the
    context's tokens less the answer's reserve."""
    assert fim.pre is not None and fim.suf is not None and fim.mid is not None
    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    head = [bos] if bos is not None else []
    middle = [
        *head,
        fim.pre,
        *prefix[len(prefix) - n_prefix :],
        *prompt,
        fim.suf,
        *suffix[:n_suffix],
        fim.mid,
    ]
    n_extra = min(len(extra), max(0, room - max(n_batch, len(middle))))
    return extra[len(extra) - n_extra :] + middle
