"""llama.cpp's own convert_hf_to_gguf.py, run on tiny transformers twins (tests/test_gguf_converter.py,
scripts/gguf_converter_sweep.py): where the converter comes from, the tokenizer it needs, and one
conversion in a subprocess.

The converter is the one vendored in the llama-cpp-python sdist the `bench` extra pins
(vendor/llama.cpp: convert_hf_to_gguf.py, its conversion/ package and its own gguf-py). It is found,
in order, at $ZOO_LLAMA_CPP_SRC (a llama.cpp tree, or the sdist's root), in the cached download
($ZOO_CACHE_DIR/llama_cpp_src), or fetched there with `pip download` (the registries CI has).

Every converter class reads a tokenizer before any tensor, and a BPE tokenizer.json passes only
when the hash of its encoding of a fixed text is one the converter knows (`get_vocab_base_pre`).
So a twin gets one of two (`TOKENIZERS`):
- "spm": a tiny SentencePiece model (tokenizer.model, 100 pieces, trained here in ~0.1 s) for the
  classes that read one (`_set_vocab_sentencepiece`: no hash; padded to config.json's vocab_size,
  so the twin keeps its 128 tokens);
- "gpt2" / "qwen2": GPT-2's or Qwen2's BPE vocabulary, rebuilt as tokenizer.json from the tree's
  own models/ggml-vocab-*.gguf, for the classes that read only tokenizer.json; the twin's
  vocab_size is then the vocabulary's rounded up to 128 (50304, 151680), and the model_type's transformers tokenizer
  class must pre-tokenize as that vocabulary's model does (Qwen2Tokenizer for the Qwen families);
  the converter refuses the others ("BPE pre-tokenizer was not recognized").
"""
from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # pyproject.toml's bench extra
SDIST = f"llama_cpp_python-{LLAMA_CPP_PYTHON}"


class Unavailable(RuntimeError):
    """The converter (or a package it imports) cannot be had here; the message says why."""


class Refused(RuntimeError):
    """The converter exited with an error on a twin; `reason` is its last error line."""

    def __init__(self, reason: str, log: str):
        super().__init__(reason)
        self.reason, self.log = reason, log


def _tree(root: Path) -> Path | None:
    """The llama.cpp tree under `root`: root itself, or the sdist's vendor/llama.cpp."""
    for cand in (root, root / "vendor" / "llama.cpp", root / SDIST / "vendor" / "llama.cpp"):
        if (cand / "convert_hf_to_gguf.py").is_file():
            return cand
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("ZOO_CACHE_DIR") or Path.home() / ".cache" / "zoo") / "llama_cpp_src"


def find_converter(fetch: bool = True) -> Path:
    """The llama.cpp tree holding convert_hf_to_gguf.py (see the module docstring)."""
    if src := os.environ.get("ZOO_LLAMA_CPP_SRC"):
        tree = _tree(Path(src))
        if tree is None:  # a set variable that points nowhere is a mistake, not a reason to download
            raise Unavailable(f"ZOO_LLAMA_CPP_SRC={src}: no convert_hf_to_gguf.py there, nor under vendor/llama.cpp; "
                              f"expected a llama.cpp tree or the {SDIST} sdist's root")
        return tree
    cache = cache_dir()
    if (tree := _tree(cache)) is not None:
        return tree
    if not fetch:
        raise Unavailable(f"no llama.cpp converter in {cache} and fetching is off")
    cache.mkdir(parents=True, exist_ok=True)
    # --no-binary for this package only: its build dependencies may come as wheels (pip prepares
    # the sdist's metadata with them)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-python",
           f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(cache)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    archive = cache / f"{SDIST}.tar.gz"
    if run.returncode != 0 or not archive.is_file():
        raise Unavailable(f"`{' '.join(cmd[2:])}` failed (exit {run.returncode}): {run.stderr.strip()[-400:]}")
    with tarfile.open(archive) as tar:  # only the converter's parts: the sdist is 77 MB of C++
        wanted = [m for m in tar.getmembers() if m.name.startswith(f"{SDIST}/vendor/llama.cpp/") and (
            m.name.count("/") == 3 and m.name.endswith(".py") or "/conversion/" in m.name or "/gguf-py/" in m.name
            or any(m.name.endswith(f"/models/ggml-vocab-{v}.gguf") for v in BPE.values()))]
        tar.extractall(cache, members=wanted, filter="data")
    archive.unlink()  # the tree is what is looked for next time
    if (tree := _tree(cache)) is None:
        raise Unavailable(f"{archive} holds no vendor/llama.cpp/convert_hf_to_gguf.py")
    return tree


def check_imports() -> None:
    """The converter's own requirements that the test extras bring (sentencepiece: its
    _set_vocab_sentencepiece imports it even before looking for tokenizer.model)."""
    try:
        import sentencepiece  # noqa: F401
    except ImportError as e:
        raise Unavailable(f"the converter needs sentencepiece ({e}): pip install -e .[test]") from e


_TEXT = ["the quick brown fox jumps over the lazy dog %d times, said Zoe." % i for i in range(200)] + [
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,;:!?'\"()[]{}-_+=*/"]


def tiny_sentencepiece(vocab: int = 100) -> bytes:
    """A SentencePiece BPE model of `vocab` pieces (ids < every twin's vocab_size), deterministic."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_TEXT), model_writer=buf, vocab_size=vocab, model_type="bpe",
                                   hard_vocab_limit=False, minloglevel=2, num_threads=1)
    return buf.getvalue()


def bpe_tokenizer_json(tree: Path, name: str) -> tuple[str, int]:
    """A byte-level BPE vocabulary of the tree's (models/ggml-vocab-{name}.gguf) as a
    tokenizer.json, and its size. Its pre-tokenizer is GPT-2's; transformers' tokenizer class of
    the twin's model_type rebuilds its own from the vocabulary and merges."""
    import gguf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    reader = gguf.GGUFReader(tree / "models" / f"ggml-vocab-{name}.gguf")
    field = reader.get_field("tokenizer.ggml.tokens")
    vocab = {bytes(field.parts[i]).decode(): n for n, i in enumerate(field.data)}
    field = reader.get_field("tokenizer.ggml.merges")
    merges = [tuple(bytes(field.parts[i]).decode().split(" ", 1)) for i in field.data]
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str(), len(vocab)


# BPE tokenizer kinds: the tree's vocabulary file each is made of
BPE = {"gpt2": "gpt-2", "qwen2": "qwen2"}


class Tokenizers:
    """The two tokenizers a twin can be given, made once: {"spm": (file name, bytes, vocab_size or
    None: the twin's own), "gpt2": ...}."""

    def __init__(self, tree: Path):
        self._tree, self._made = tree, {}

    def __getitem__(self, kind: str):
        if kind not in self._made:
            if kind == "spm":
                self._made[kind] = ("tokenizer.model", tiny_sentencepiece(), None)
            elif kind in BPE:
                text, size = bpe_tokenizer_json(self._tree, BPE[kind])
                # the twin's vocab_size rounded up to 128 rows, as released models pad theirs: the
                # Mamba2 converters pad the token list to a multiple of 8 (pad_vocab_size_multiple)
                self._made[kind] = ("tokenizer.json", text.encode(), -(-size // 128) * 128)
            else:
                raise KeyError(f"tokenizer {kind!r}: expected one of spm, {', '.join(BPE)}")
        return self._made[kind]


def convert(tree: Path, model_dir: Path, out: Path, outtype: str = "f32", timeout: float = 300) -> Path:
    """convert_hf_to_gguf.py model_dir --outtype outtype --outfile out, in a subprocess with the
    tree's own gguf-py first on the path (the converter's own choice too, unless NO_LOCAL_GGUF)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree / "gguf-py"), os.environ.get("PYTHONPATH")])))
    env.pop("NO_LOCAL_GGUF", None)
    run = subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", outtype,
                          "--outfile", str(out)], capture_output=True, text=True, env=env, timeout=timeout)
    if run.returncode != 0 or not out.is_file():
        lines = [ln.strip() for ln in run.stderr.splitlines() if ln.strip(" ^~\n")]  # not the carets under a line
        reason = lines[-1] if lines else f"exit {run.returncode}"
        if ":" not in reason and len(lines) > 1:  # a bare `assert`: the line that failed says what
            reason = f"{reason} at `{lines[-2]}`"
        raise Refused(reason, run.stderr)
    return out
