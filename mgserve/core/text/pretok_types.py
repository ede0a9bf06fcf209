"""BPE pre-tokenizer types: each ``tokenizer.ggml.pre`` name llama.cpp 0.3.36 knows, the regexes
it splits text with and its per-type settings, exactly as llama-vocab.cpp has them (pretok.py runs
the regexes).

Each type is a list of regexes applied one after another. llama.cpp runs some through
hand-written splitters; for the GPT-2, Llama 3, Qwen 2 and Qwen 3.5 ones these agree with the
regex itself, and the two that do not (Kimi-K2's, and the digit grouping of AFMoE and Tiny Aya)
are named here by markers that pretok.py replaces with splitters of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

_C = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"  # contractions
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_TAIL = r"|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*" + _TAIL
_QWEN2 = _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*" + _TAIL
_QWEN35 = _C + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*" + _TAIL
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_ASCII_PUNCT = r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~]"""
_DS3 = (
    _ASCII_PUNCT + r"[A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+"
)  # followed by a per-type tail
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_GPT4O_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n/]*" + _TAIL


def _cased(letter: str, c: str) -> str:
    """Tekken / GPT-4o letter runs: upper* lower+ | upper+ lower* (with lookahead classes)."""
    up = rf"((?=[{letter}])([^a-z]))"
    low = rf"((?=[{letter}])([^A-Z]))"
    return rf"[^\r\n\p{{L}}\p{{N}}]?{up}*{low}+{c}|[^\r\n\p{{L}}\p{{N}}]?{up}+{low}*{c}"


_PORO = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_NEWLINES = r"[^\n]+|[\n]+"
_DEEPSEEK_LETTERS = (
    r"\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    r"\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    r"\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    r"\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
    r"\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    r"\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
    r"\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
    r"\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    r"\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    r"\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    r"\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    r"\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    r"\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
# unicode.cpp's own splitters that are not their regex: markers for our replacements
AFMOE_DIGITS = r"\p{AFMoE_digits}"
AYA_DIGITS = r"\d{1,3}(?=(?:\d{3})*\b)"
KIMI = r"\p{Han}+"
# what runs for KIMI: unicode_regex_split_custom_kimi_k2 on the collapsed text whose Han letters
# are \xd6 and other letters \xd2 (unicode.py)
_L_ANY = "\xd2\xd6A-Za-z"
KIMI_COLLAPSED = (
    rf"\xd6+|[^\r\n{_L_ANY}\xd10-9]?[\xd2A-Za-z]+{_C}?|[\xd10-9]{{1,3}}"
    rf"| ?[^\s{_L_ANY}\xd10-9]+[\r\n]*" + _TAIL
)
# regexes that are quadratic when searched naively: pretok.py runs equivalent splitters
TRAILING_SPACE = r"\s+$"  # deepseek-llm's; quadratic in a space run
DIGIT_TRIPLES = r"(?=(\d{3})+(?!\d))"  # superbpe's; quadratic in a digit run

# LLAMA_VOCAB_PRE_TYPE_* -> regexes (llm_tokenizer_bpe's constructor)
REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "llama3": (_LLAMA3,),
    "jais2": (
        _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        + "".join(rf"|\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4))
        + r"|\s{1,2}(?!\S)|\s{1}",
    ),
    "deepseek-llm": (
        "[\r\n]", _DEEPSEEK_LETTERS,
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", TRAILING_SPACE, _CJK,
        r"\p{N}+",
    ),
    "deepseek3": (r"\p{N}{1,3}", _CJK_KANA, _DS3 + r"[\r\n]*" + _TAIL),
    "spark2_5": (
        r"\p{N}{1,3}", _CJK_KANA, _DS3 + r"|[\r\n]|\s+(?!\S)|\s+", r"\p{N}",
    ),
    "youtu": (
        "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b"
        "\uff0c\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|" + _CJK_KANA,
        rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_C}?|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
        + _C + r"?|\p{N}" + _GPT4O_TAIL,
    ),
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    "starcoder": (r"\p{N}", _GPT2),
    "gpt2": (_GPT2,),
    "qwen2": (_QWEN2,),
    "qwen35": (_QWEN35,),
    "poro": (_PORO,),
    "viking": (_PORO, r"\p{N}"),
    "tekken": (_cased(r"\p{L}", "") + r"|\p{N}" + _GPT4O_TAIL,),
    "chameleon": (
        r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )",
        r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", _GPT2,
    ),
    "gpt4o": (_cased(r"\p{L}", _C + "?") + r"|\p{N}{1,3}" + _GPT4O_TAIL,),
    "granite-emb-multi": (_cased(r"\p{L}\p{M}", _C + "?") + r"|\p{N}{1,3}" + _GPT4O_TAIL,),
    "tiny-aya": (
        AYA_DIGITS,
        rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_C}?|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
        + _C + r"?|\p{N}{1,3}" + _GPT4O_TAIL,
    ),
    "kimi-k2": (KIMI,),
    "superbpe": (r"\p{N}+", DIGIT_TRIPLES),
    "bailingmoe": (
        r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "seed-coder": (
        _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+" + _TAIL,
    ),
    "ufakzeka": (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*" + _TAIL,),
    "afmoe": (
        AFMOE_DIGITS,
        "[\u4e00-\u9fff\u3400-\u4dbf\u8c48-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f"
        "\u2f00-\u2fdf\u0e40-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f"
        "\ua9e0-\ua9ff\uac00-\ud7af\u1100-\u11ff]+",
        _DS3 + r"[\r\n]*" + _TAIL,
    ),
    "laguna": (_NEWLINES, _QWEN2),
    "exaone-moe": (
        _C + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "newlines": (_NEWLINES,),
    "minicpm5": (
        r"\p{N}{1,3}",
        _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*" + _TAIL,
    ),
    "whitespace": (r"\S+",),
}  # fmt: skip


@dataclass(frozen=True)
class PreType:
    """What one ``tokenizer.ggml.pre`` value means to llama.cpp's BPE tokenizer."""

    regexes: str  # key of REGEXES
    ignore_merges: bool = False  # a word that is a vocab token is taken whole
    add_bos: bool = False  # default when tokenizer.ggml.add_bos_token is absent
    clean_spaces: bool = True  # detokenizer's " ." / " 's" clean-up
    escape_whitespaces: bool = False  # spaces become U+2581 before splitting (gemma4)
    byte_encode: bool = True  # words go through GPT-2's byte -> character map
    no_bos: bool = False  # the default BOS id is none (chatglm)
    newline_words: bool = False  # a word of only "\n" that is a vocab token is taken whole
    force_bos: bool = False  # add_bos even when the file says false (llama.cpp's Gemma 4 fix)


def _names(regexes: str, names: str, **kw: bool) -> dict[str, PreType]:
    return {name: PreType(regexes, **kw) for name in names.split()}


_NC = {"clean_spaces": False}
PRE_TYPES: dict[str, PreType] = {
    **_names("default", "default"),
    **_names("minicpm5", "minicpm5", ignore_merges=True),
    **_names(
        "llama3", "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
        ignore_merges=True, add_bos=True,
    ),
    **_names("deepseek-llm", "deepseek-llm", **_NC),
    **_names("deepseek-coder", "deepseek-coder", **_NC),
    **_names("deepseek3", "deepseek-v3 hunyuan-dense hy_v4 joyai-llm", **_NC),
    **_names("spark2_5", "spark2_5", **_NC),
    **_names("youtu", "youtu", ignore_merges=True, **_NC),
    **_names("falcon", "falcon"),
    **_names(
        "gpt2",
        "mpt gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum "
        "modern-bert jina-v1-en jina-v2-code roberta-bpe olmo jais exaone4",
    ),
    **_names("gpt2", "trillion granite-docling", **_NC),
    **_names("jais2", "jais-2"),
    **_names("newlines", "gemma4 granite-embed-multi-311m", escape_whitespaces=True,
             byte_encode=False, newline_words=True, force_bos=True),
    **_names("newlines", "sarvam-moe", escape_whitespaces=True, byte_encode=False, **_NC),
    **_names("whitespace", "whitespace", byte_encode=False),
    **_names("starcoder", "starcoder refact codeshell exaone minerva-7b mellum2"),
    **_names("starcoder", "command-r smollm", **_NC),
    **_names("qwen2", "qwen2 deepseek-r1-qwen kormo f2llmv2 hunyuan solar-open", **_NC),
    **_names("qwen2", "stablelm2 megrez"),
    **_names("qwen2", "grok-2", **_NC),
    **_names("qwen35", "qwen35", **_NC),
    **_names("llama3", "dbrx smaug-bpe"),
    **_names("llama3", "chatglm-bpe", no_bos=True),
    **_names("llama3", "glm4 glm5", no_bos=True, ignore_merges=True),
    **_names("poro", "poro-chat", **_NC),
    **_names("poro", "bloom gpt3-finnish"),
    **_names("viking", "viking", **_NC),
    **_names("tekken", "tekken", ignore_merges=True, add_bos=True, **_NC),
    **_names("exaone-moe", "exaone-moe"),
    **_names("chameleon", "chameleon", add_bos=True, **_NC),
    **_names("gpt4o", "gpt-4o llama4 kanana2 talkie minimax-m2", **_NC),
    **_names("granite-emb-multi", "granite-embed-multi-97m", ignore_merges=True, **_NC),
    **_names("tiny-aya", "tiny_aya cohere2moe", **_NC),
    **_names("superbpe", "superbpe", **_NC),
    **_names("bailingmoe", "bailingmoe bailingmoe2 llada-moe", **_NC),
    **_names("seed-coder", "seed-coder", **_NC),
    **_names("kimi-k2", "kimi-k2", **_NC),
    **_names("ufakzeka", "ufakzeka", **_NC),
    **_names("afmoe", "afmoe", **_NC),
    **_names("laguna", "laguna", **_NC),
}  # fmt: skip
