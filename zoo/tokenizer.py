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
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from .compiler.errors import ZooError

if TYPE_CHECKING:
    from .compiler.checkpoint.gguf import GGUFSource

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL = 3
_USER_DEFINED = 4

# Llama 3's split: contractions case-insensitively, letters with at most one leading non-letter,
# digits in runs of up to three, punctuation runs swallowing trailing newlines.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3")


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
    if pre in _LLAMA3_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    supported = ", ".join(("default", "gpt2", "smollm", *_LLAMA3_PRE))
    raise ZooError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: {supported})")


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
        """From the `tokenizer.*` metadata of a GGUF file (byte-level BPE, "gpt2" model only).

        Tokens of type CONTROL become special added tokens (kept whole, dropped by
        `decode(skip_special_tokens=True)`), USER_DEFINED ones plain added tokens.
        `tokenizer.ggml.add_space_prefix` is not applied: llama.cpp uses it for SentencePiece
        vocabularies only.
        """
        model = source.metadata("tokenizer.ggml.model")
        if model != "gpt2":
            raise ZooError(f"{source.description}: unsupported GGUF tokenizer model {model!r} (supported: gpt2)")
        pre = source.metadata("tokenizer.ggml.pre", "default")
        tokens: list[str] | None = source.metadata("tokenizer.ggml.tokens")
        merges: list[str] | None = source.metadata("tokenizer.ggml.merges")
        if not tokens or not merges:
            # Without merges byte-level BPE would silently fall apart into single bytes.
            raise ZooError(f"{source.description}: GGUF tokenizer needs tokenizer.ggml.tokens and tokenizer.ggml.merges")
        token_types: list[int] = source.metadata("tokenizer.ggml.token_type", [])

        backend = Backend(models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=[tuple(m.split(" ", 1)) for m in merges],
            # llama.cpp looks a whole Llama-3 pre-token up in the vocabulary before merging.
            ignore_merges=pre in _LLAMA3_PRE,
        ))
        backend.pre_tokenizer = _gguf_pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
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
            # llama.cpp adds BOS by default for Llama-3 vocabularies only.
            add_bos=bool(source.metadata("tokenizer.ggml.add_bos_token", pre in _LLAMA3_PRE)),
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
