"""Tokenizer and chat template for a compiled model.

A thin layer over a `tokenizers.Tokenizer` that is built either from a Hugging Face model
directory (tokenizer.json and friends) or from the metadata of a GGUF file, plus rendering of the
model's jinja chat template and incremental (streaming) detokenization.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from .compiler.errors import ZooError

if TYPE_CHECKING:
    from .compiler.checkpoint.gguf import GGUFSource

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL = 3
_USER_DEFINED = 4

# llama.cpp's `tokenizer.ggml.pre` names -> the split its merges were learned with: one entry per
# split of llama.cpp's src/llama-vocab.cpp (a LLAMA_VOCAB_PRE_TYPE and its regexes, which llama.cpp
# applies in turn, each to the pieces the previous ones left, keeping the unmatched gaps as pieces),
# with the per-name flags that change ids (ignore_merges: a whole pre-token found in the vocabulary
# is kept before merging; add_bos: BOS by default). The regexes are spelled for `tokenizers`
# (Oniguruma) so that they match what llama.cpp's matcher matches: llama.cpp runs a regex over text
# whose non-ASCII characters are collapsed to their category, so \p{Lu}/\p{Ll}/... all mean \p{L}
# there, its letter classes leave out marks unless a regex names \p{M}, and `$` is the end of the
# piece (\z here). Regexes llama.cpp
# implements by hand (GPT-2's, Llama 3's, Kimi K2's, AFMoE's digits) are written as the regex the
# hand-written matcher implements.
_C = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"  # contractions, case-insensitive
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_C + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_JAIS2 = (_C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)"
          r"|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}")
# Upper-then-lower letter runs (GPT-4o, Tekken): a letter that is not a-z, then letters that are
# not A-Z (llama.cpp's rewrite of \p{Lu}..\p{Ll}, which it cannot tell apart beyond ASCII).
_UP, _LOW = r"(?:(?=\p{L})[^a-z])", r"(?:(?=\p{L})[^A-Z])"
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UP}*{_LOW}+{_C}?|[^\r\n\p{{L}}\p{{N}}]?{_UP}+{_LOW}*{_C}?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UP}*{_LOW}+|[^\r\n\p{{L}}\p{{N}}]?{_UP}+{_LOW}*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_UP_M, _LOW_M = r"(?:(?=[\p{L}\p{M}])[^a-z])", r"(?:(?=[\p{L}\p{M}])[^A-Z])"
_GRANITE_EMB = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UP_M}*{_LOW_M}+{_C}?|[^\r\n\p{{L}}\p{{N}}]?{_UP_M}+{_LOW_M}*{_C}?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Cased letter classes written with \p{Lu}.. that llama.cpp reads as letters or marks (Tiny Aya, Youtu).
_LM_WORDS = (rf"[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}\p{{M}}]*[\p{{L}}\p{{M}}]+{_C}?"
             rf"|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}\p{{M}}]+[\p{{L}}\p{{M}}]*{_C}?")
# ASCII punctuation glued to an ASCII word, letters with marks, punctuation/symbol runs (DeepSeek-V3 and kin)
_PS = r"[\p{P}\p{S}]"
_PUNCT_WORD = r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
_DEEPSEEK3 = _PUNCT_WORD + rf"| ?{_PS}+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_CJK_KANA = r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+"
_CJK_HANGUL = r"[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+"
_DEEPSEEK_LETTERS = (
    r"\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF}"
    r"\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}"
    r"\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}"
    r"\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}"
    r"\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}"
    r"\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}"
    r"\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}"
    r"\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}"
    r"\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}"
    r"\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}"
    r"\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}"
    r"\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}"
    r"\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+"
)
_BLOOM = r" ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{964}\x{6D4}\x{60C})]+"
# Kimi K2: Han runs apart, then GPT-4o-like words over the other letters (llama.cpp's hand-written
# matcher, its Han ranges)
_HAN = (r"\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{20000}-\x{2A6DF}\x{2A700}-\x{2B73F}\x{2B740}-\x{2B81F}"
        r"\x{2B820}-\x{2CEAF}\x{2CEB0}-\x{2EBEF}\x{F900}-\x{FAFF}\x{2F800}-\x{2FA1F}")
_KIMI_K2 = (rf"[{_HAN}]+|[^\r\n\p{{L}}\p{{N}}]?(?:(?![{_HAN}])\p{{L}})+{_C}?"
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# AFMoE: a digit run as its leading len % 3 digits, then groups of three
_AFMOE_DIGITS = r"(?<!\p{N})\p{N}{1,2}(?=(?:\p{N}{3})*(?!\p{N}))|\p{N}{3}"
_AFMOE_SCRIPTS = (r"[\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{8C48}-\x{FAFF}\x{3040}-\x{309F}\x{30A0}-\x{30FF}"
                  r"\x{FF65}-\x{FF9F}\x{2F00}-\x{2FDF}\x{E40}-\x{E7F}\x{E80}-\x{EFF}\x{1780}-\x{17FF}"
                  r"\x{1000}-\x{109F}\x{AA60}-\x{AA7F}\x{A9E0}-\x{A9FF}\x{AC00}-\x{D7AF}\x{1100}-\x{11FF}]+")
_YOUTU_SCRIPTS = (r"[\x{AC00}-\x{D7A3}\x{3131}-\x{318E}]+|[\x{FF01}\x{2026}\x{201C}\x{201D}\x{2018}\x{2019}"
                  r"\x{2014}\x{FF1A}\x{FF1B}\x{FF0C}\x{3001}-\x{303F}\x{FE30}-\x{FE4F}]+|[\x{3105}-\x{312F}]+|"
                  + _CJK_KANA)
_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"


@dataclass(frozen=True)
class _Split:
    names: tuple[str, ...]
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


_SPLIT_TABLE = (
    _Split(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
            "jina-v5-nano"), (_LLAMA3,), ignore_merges=True, add_bos=True),
    _Split(("dbrx", "smaug-bpe", "glm4", "chatglm-bpe"), (_LLAMA3,)),
    _Split(("default",), (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
    # "gpt2" is not llama.cpp's name (that is "gpt-2"); zoo has always read it as GPT-2's split
    _Split(("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "exaone4", "trillion", "granite-docling",
            "gigachat", "a.x-4.0", "mellum", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de", "modern-bert"),
           (_GPT2,)),
    _Split(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
           (r"\p{N}", _GPT2)),
    _Split(("falcon",), (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
    _Split(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open",
            "grok-2"), (_QWEN2,)),
    _Split(("qwen35",), (_QWEN35,)),
    _Split(("jais-2",), (_JAIS2,)),
    _Split(("deepseek-llm",), ("[\r\n]", _DEEPSEEK_LETTERS,
                               r"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+",
                               r"\s+\z", _CJK_HANGUL, r"\p{N}+")),
    _Split(("deepseek-coder",), ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")),
    _Split(("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), (r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3)),
    _Split(("spark2_5",), (r"\p{N}{1,3}", _CJK_KANA,
                           _PUNCT_WORD + rf"| ?{_PS}+|[\r\n]|\s+(?!\S)|\s+", r"\p{N}")),
    _Split(("afmoe",), (_AFMOE_DIGITS, _AFMOE_SCRIPTS, _DEEPSEEK3)),
    _Split(("poro-chat", "bloom", "gpt3-finnish"), (_BLOOM,)),
    _Split(("viking",), (_BLOOM, r"\p{N}")),
    _Split(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), (_GPT4O,)),
    _Split(("tekken",), (_TEKKEN,), ignore_merges=True, add_bos=True),
    _Split(("granite-embed-multi-97m",), (_GRANITE_EMB,), ignore_merges=True),
    _Split(("tiny_aya", "cohere2moe"), (r"[0-9]{1,3}(?=(?:[0-9]{3})*(?![0-9A-Za-z_]))",
                                        _LM_WORDS + r"|\p{N}{1,3}" + _TAIL)),
    _Split(("youtu",), (_YOUTU_SCRIPTS, _LM_WORDS + r"|\p{N}" + _TAIL), ignore_merges=True),
    _Split(("kimi-k2",), (_KIMI_K2,)),
    _Split(("bailingmoe", "bailingmoe2", "llada-moe"),
           (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",)),
    _Split(("seed-coder",), (_C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
                             r"|\s+(?!\S)|\s+",)),
    _Split(("ufakzeka",), (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",)),
    _Split(("laguna",), (r"[^\n]+|[\n]+", _QWEN2)),
    _Split(("exaone-moe",), (_C + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
                             r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",)),
    _Split(("minicpm5",), (r"\p{N}{1,3}", _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
                                                  r"|\s*[\r\n]+|\s+(?!\S)|\s+"), ignore_merges=True),
    _Split(("chameleon",), ("<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\t\n]|    |  )",
                            r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", _GPT2), add_bos=True),
)
_SPLITS = {name: split for split in _SPLIT_TABLE for name in split.names}
# llama.cpp names whose vocabulary is not byte-level BPE over these splits: why zoo refuses them
_REFUSED_PRE = {
    **dict.fromkeys(("gemma4", "granite-embed-multi-311m", "sarvam-moe"),
                    "a SentencePiece-style BPE over raw UTF-8 (not byte-level)"),
    "whitespace": "a whitespace-split vocabulary (not byte-level)",
    **dict.fromkeys(("jina-v1-en", "jina-v2-code", "roberta-bpe"), "an encoder vocabulary that appends a SEP token"),
    "superbpe": "a zero-width digit split (lookahead-only matches) that zoo does not reproduce",
}
# SentencePiece vocabularies (`tokenizer.ggml.model` llama) as an architecture's conf/gguf map
# names them (`tokenizer: {sentencepiece: ...}`): how its spaces are spelled and its merges ranked
_SENTENCEPIECE = ("llama", "gemma", "phi3")


def _gguf_split(pre: str, description: str) -> _Split:
    """The split llama.cpp applies for the `tokenizer.ggml.pre` name `pre` (how the merges were learned)."""
    if pre in _SPLITS:
        return _SPLITS[pre]
    if pre in _REFUSED_PRE:
        raise ZooError(f"{description}: unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre): it is "
                       f"{_REFUSED_PRE[pre]}; zoo reads byte-level BPE with one of: {', '.join(sorted(_SPLITS))}")
    raise ZooError(f"{description}: unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre; supported: "
                   f"{', '.join(sorted(_SPLITS))})")


def _gguf_pre_tokenizer(split: _Split):
    """llama.cpp's regexes in turn (each piece the previous ones left is split again; unmatched gaps
    stay pieces, as `isolated` keeps them), then the byte-to-unicode spelling GGUF byte-level
    vocabularies are written in."""
    return pre_tokenizers.Sequence([
        *(pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in split.regexes),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges implied by a vocabulary: every split of a token into two tokens,
    ranked by the whole token's score (higher first), then the longer left part; within a token
    by the parts' ids (transformers' generate_merges, the order its GGUF loader uses)."""
    merges = []
    for token, score in scores.items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)  # stable: ties keep their order
    return [(left, right) for left, right, _ in merges]


def _sentencepiece_backend(tokens: list[str], scores: list[float], flavour: str, add_space_prefix: bool) -> Backend:
    """A SentencePiece BPE vocabulary (byte fallback through its <0xXX> tokens) as a Backend.

    llama: "▁" for spaces and a leading one (add_space_prefix), merges ranked by the tokens'
    scores. gemma: no leading space; tokens of spaces stored as spaces are the "▁" runs the
    text has, and the file order ranks the merges (Gemma's scores do not). phi3: llama's, with the
    leading space prepended to the whole text rather than to its first piece.
    """
    if flavour == "gemma":
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        ranks = {t: -i for i, t in enumerate(tokens)}
    else:
        ranks = dict(zip(tokens, scores))
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = "<unk>" if flavour == "gemma" else None
    backend = Backend(models.BPE(vocab=vocab, merges=_merges_from_scores(vocab, ranks), fuse_unk=True,
                                 byte_fallback=True, unk_token=unk))
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if flavour == "gemma":
        backend.normalizer = normalizers.Replace(" ", "▁")
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif flavour == "phi3":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False)
        if add_space_prefix:
            steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


class Tokenizer:
    """Text <-> token ids, chat template rendering.

    Attributes: bos_id (int | None), eos_ids (set[int]: any of them ends generation),
    vocab_size (int, including added tokens), chat_template (str | None).
    """

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_eos_ids: set[int] | frozenset[int] = frozenset(),
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: str | None = None,
    ):
        self._backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_id = backend.token_to_id(bos_token) if bos_token is not None else None
        self.eos_id = backend.token_to_id(eos_token) if eos_token is not None else None
        self.eos_ids = set(extra_eos_ids) | ({self.eos_id} if self.eos_id is not None else set())
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None
        # A tokenizer.json post-processor may already add BOS/EOS; add them only where it does not.
        empty = backend.encode("", add_special_tokens=True).ids
        self._prepend_bos = add_bos and self.bos_id is not None and empty[:1] != [self.bos_id]
        self._append_eos = add_eos and self.eos_id is not None and empty[-1:] != [self.eos_id]

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """From a Hugging Face model directory.

        Reads tokenizer.json (required), tokenizer_config.json (special tokens, add_bos_token,
        chat_template), chat_template.jinja (newer transformers save the template there; it wins),
        eos_token_id (an int or a list) from config.json and generation_config.json, and
        bos_token_id from config.json when tokenizer_config.json names no bos_token.
        """
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ZooError(f"{path}: no tokenizer.json")
        backend = Backend.from_file(str(path / "tokenizer.json"))
        tok_cfg = _read_json(path / "tokenizer_config.json")

        chat_template = tok_cfg.get("chat_template")
        if isinstance(chat_template, list):  # [{"name": ..., "template": ...}, ...]
            chat_template = {t["name"]: t["template"] for t in chat_template}.get("default")
        if (path / "chat_template.jinja").is_file():
            chat_template = (path / "chat_template.jinja").read_text(encoding="utf-8")

        model_cfg = _read_json(path / "config.json")
        extra_eos = _id_set(model_cfg.get("eos_token_id"))
        extra_eos |= _id_set(_read_json(path / "generation_config.json").get("eos_token_id"))
        bos_token = _token_content(tok_cfg.get("bos_token"))
        if bos_token is None and isinstance(model_cfg.get("bos_token_id"), int):
            bos_token = backend.id_to_token(model_cfg["bos_token_id"])

        return cls(
            backend,
            bos_token=bos_token,
            eos_token=_token_content(tok_cfg.get("eos_token")),
            extra_eos_ids=extra_eos,
            add_bos=bool(tok_cfg.get("add_bos_token", False)),
            add_eos=bool(tok_cfg.get("add_eos_token", False)),
            chat_template=chat_template,
        )

    @classmethod
    def from_gguf(cls, source: GGUFSource) -> Tokenizer:
        """From the `tokenizer.*` metadata of a GGUF file: byte-level BPE ("gpt2": tokens, merges,
        the split `tokenizer.ggml.pre` names) or SentencePiece BPE ("llama": tokens, scores, byte
        fallback; the architecture's map says which spelling, see _sentencepiece_backend).

        Tokens of type CONTROL become special added tokens (kept whole, dropped by
        `decode(skip_special_tokens=True)`), USER_DEFINED ones plain added tokens.
        `tokenizer.ggml.add_space_prefix` applies to SentencePiece vocabularies only (llama.cpp's
        rule). Nothing from the file is executed: the chat template renders in a sandbox.
        """
        model = source.metadata("tokenizer.ggml.model")
        tokens: list[str] | None = source.metadata("tokenizer.ggml.tokens")
        token_types: list[int] = source.metadata("tokenizer.ggml.token_type", [])
        if not tokens:
            raise ZooError(f"{source.description}: GGUF tokenizer needs tokenizer.ggml.tokens")
        pre = source.metadata("tokenizer.ggml.pre", "default")
        if model == "gpt2":
            merges: list[str] | None = source.metadata("tokenizer.ggml.merges")
            if not merges:
                # Without merges byte-level BPE would silently fall apart into single bytes.
                raise ZooError(f"{source.description}: GGUF tokenizer needs tokenizer.ggml.tokens and tokenizer.ggml.merges")
            split = _gguf_split(pre, source.description)
            backend = Backend(models.BPE(
                vocab={t: i for i, t in enumerate(tokens)},
                merges=[tuple(m.split(" ", 1)) for m in merges],
                # llama.cpp looks a whole pre-token up in the vocabulary before merging (Llama 3, Tekken, ...)
                ignore_merges=split.ignore_merges,
            ))
            backend.pre_tokenizer = _gguf_pre_tokenizer(split)
            backend.decoder = decoders.ByteLevel()
            add_bos_default = split.add_bos  # llama.cpp's default for this name (Llama 3, Tekken, Chameleon)
        elif model == "llama":
            scores: list[float] | None = source.metadata("tokenizer.ggml.scores")
            if not scores or len(scores) != len(tokens):
                raise ZooError(f"{source.description}: a SentencePiece GGUF tokenizer needs tokenizer.ggml.scores, "
                               f"one per token ({len(scores or [])} for {len(tokens)} tokens)")
            flavour = source.tokenizer_options().get("sentencepiece", "llama")
            if flavour not in _SENTENCEPIECE:
                raise ZooError(f"{source.description}: the map's tokenizer.sentencepiece {flavour!r} is not one of "
                               f"{', '.join(_SENTENCEPIECE)}")
            backend = _sentencepiece_backend(tokens, scores, flavour,
                                             bool(source.metadata("tokenizer.ggml.add_space_prefix", True)))
            add_bos_default = True  # llama.cpp adds BOS to a SentencePiece vocabulary unless told otherwise
        else:
            raise ZooError(f"{source.description}: unsupported GGUF tokenizer model {model!r} (supported: gpt2, llama)")
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, token_types) if k == _CONTROL]
        )
        backend.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, token_types) if k == _USER_DEFINED]
        )

        def token(key: str) -> str | None:
            token_id = source.metadata(f"tokenizer.ggml.{key}")
            return tokens[token_id] if token_id is not None else None

        extra_eos = {
            token_id
            for key in ("eot_token_id", "eom_token_id")
            if (token_id := source.metadata(f"tokenizer.ggml.{key}")) is not None
        }
        return cls(
            backend,
            bos_token=token("bos_token_id"),
            eos_token=token("eos_token_id"),
            extra_eos_ids=extra_eos,
            add_bos=bool(source.metadata("tokenizer.ggml.add_bos_token", add_bos_default)),
            add_eos=bool(source.metadata("tokenizer.ggml.add_eos_token", False)),
            chat_template=source.metadata("tokenizer.chat_template"),
        )

    # -- encode / decode ------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings in it (e.g. "<|im_start|>") map to their ids."""
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            ids = [self.bos_id, *ids]
        if add_special_tokens and self._append_eos:
            ids = [*ids, self.eos_id]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """A fresh incremental decoder over this tokenizer."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    # -- chat -----------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs: Any) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the model's chat template.

        tools: the request's tools as the OpenAI API writes them ([{"type": "function",
        "function": {...}}]), passed to the template as `tools` (templates that know tools render
        them; None leaves `tools` undefined, as transformers does). kwargs: further template
        variables (chat_template_kwargs: enable_thinking, ...)."""
        if self.chat_template is None:
            raise ZooError("this tokenizer has no chat template")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        try:
            return self._template.render(
                **kwargs,
                **({"tools": tools} if tools is not None else {}),
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as e:
            raise ZooError(f"chat template: {e}") from e


class StreamDecoder:
    """Incremental detokenization: feed ids one at a time, get only the newly completed text.

    Each step decodes a short window: the tokens already emitted since the last anchor (for
    context: some decoders render a token differently at the start of a sequence) plus the new
    ones, and returns what the window added. Text ending in U+FFFD is an incomplete UTF-8
    character (a multi-byte character split across tokens) and is held back until it completes,
    or until `flush`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # end of the tokens whose text has been returned

    def feed(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is still held back (e.g. a dangling partial character, as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        decode = self._tokenizer.decode
        done = decode(self._ids[self._prefix:self._read], skip_special_tokens=self._skip)
        text = decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
        if len(text) <= len(done) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done):]


def _compile_template(source: str) -> jinja2.Template:
    """Chat templates are untrusted code: render them in jinja's immutable sandbox, with the
    whitespace handling and helpers Hugging Face templates are written against."""

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators=None, sort_keys: bool = False) -> str:
        # Jinja's own tojson HTML-escapes; templates expect plain JSON.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ZooError(f"chat template does not compile: {e}") from e


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(token: str | dict | None) -> str | None:
    """tokenizer_config.json writes special tokens as a string or an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


def _id_set(value: int | list[int] | None) -> set[int]:
    if value is None:
        return set()
    return set(value) if isinstance(value, list) else {value}
