"""Tokenizer and chat template for a compiled model.

A thin layer over a `tokenizers.Tokenizer` that is built either from a Hugging Face model
directory (tokenizer.json and friends) or from the metadata of a GGUF file, plus rendering of the
model's jinja chat template and incremental (streaming) detokenization.
"""
from __future__ import annotations

import json
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

# llama.cpp's `tokenizer.ggml.pre` names -> the split its merges were learned with (llama.cpp's
# llama-vocab.cpp; transformers' GGUF loader keeps the same table). Letters with at most one
# leading non-letter, digits in runs of up to three (Llama 3) or one by one (Qwen2), punctuation
# runs swallowing trailing newlines.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3")
_SPLITS = {
    **dict.fromkeys((*_LLAMA3_PRE, "falcon3", "pixtral", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}
# SentencePiece vocabularies (`tokenizer.ggml.model` llama) as an architecture's conf/gguf map
# names them (`tokenizer: {sentencepiece: ...}`): how its spaces are spelled and its merges ranked
_SENTENCEPIECE = ("llama", "gemma", "phi3")


def _gguf_pre_tokenizer(pre: str):
    """The pre-tokenizer for llama.cpp's `tokenizer.ggml.pre` name (how the merges were learned).

    ByteLevel(use_regex=True) applies GPT-2's split; its byte-to-unicode spelling is what GGUF
    byte-level vocabularies are written in.
    """
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("gpt2", "default"):
        # "default" means the converter did not recognise the tokenizer; GPT-2's split is the
        # generic byte-level choice (llama.cpp warns that quality may degrade).
        return gpt2
    if pre == "smollm":
        # GPT-2's split after putting every digit on its own.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    supported = ", ".join(sorted(("default", "gpt2", "smollm", *_SPLITS)))
    raise ZooError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: {supported})")


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
            backend = Backend(models.BPE(
                vocab={t: i for i, t in enumerate(tokens)},
                merges=[tuple(m.split(" ", 1)) for m in merges],
                # llama.cpp looks a whole Llama-3 pre-token up in the vocabulary before merging.
                ignore_merges=pre in _LLAMA3_PRE,
            ))
            backend.pre_tokenizer = _gguf_pre_tokenizer(pre)
            backend.decoder = decoders.ByteLevel()
            add_bos_default = pre in _LLAMA3_PRE  # llama.cpp adds BOS by default for Llama-3 vocabularies only
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
