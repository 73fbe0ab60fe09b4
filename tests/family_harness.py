"""One parity harness for every family: a tiny random transformers checkpoint against zoo's model
of it, prefill and every greedy decode step, decode through the caches == one prefill, eager and
compiled, and the compiled graph counts. tests/test_family_parity.py holds the table (one `Family`
per checkpoint) and runs it; the family files keep only their special behaviours and reach the
same checkpoints and eager models through the session fixture `families` (tests/conftest.py),
so each reference is built, saved and loaded once per session.

Plugging a family in (tests/test_family_parity.py's FAMILIES), a few lines of data:

    "myfam": Family(
        make=lambda: tiny_reference(transformers.MyFamForCausalLM, transformers.MyFamConfig(**DIMS), randomize),
        eager=(Parity(11, 8), DecodeEqualsPrefill(25, 9)),      # prompt length, decode steps
        compiled=(Parity(11, 4), Parity(2, 2), DecodeEqualsPrefill(25, 9)),
        graphs=2,                                   # compiled graphs per entry point after all of it
        rtol=1e-4, max_seq=64, overrides=("mixers.linear.chunk_size=16",)),

- `make()` returns transformers' model (float32, eval) of a tiny config with odd sizes, its
  constant-initialised weights (norms, biases, selection biases) made random so that a misplaced
  one shows; `tiny_reference` seeds, builds and randomizes. It is saved with save_pretrained
  (`save_kwargs`, e.g. max_shard_size to shard) or by `save(ref, path)` (a Hub layout transformers
  does not write), and loaded by zoo.from_pretrained from that directory, as a user loads it;
  with hub=True also by Hub id from an offline local cache (HF_HUB_OFFLINE=1) in one fresh process
  for all such families, its prefill compared with transformers at `rtol`.
- Checks run in order on one model: `Parity(L, steps)` compares the prefill of a [B, L] prompt
  and each of `steps` greedy decode steps with transformers' full forward over the same tokens
  (tests/helpers.check_parity); `DecodeEqualsPrefill(L, P)` decodes tokens P.. of a [B, L]
  sequence one by one and compares with one prefill of it. B is the family's `batch` (>= 2
  unless a check sets its own), tokens come from a generator seeded per check (`seed`), every
  comparison at the family's `rtol` (|a - e| <= rtol |e| + rtol max|e|).
- `compiled` checks run on a compile=True model built for the test (not kept); `graphs` is then
  the exact count of compiled graphs per entry point (one per layer kind: no recompiles across
  prompt lengths), `after_compiled(model)` any further assertion on it.
- `guard(ref, model, seq)` runs on each sequence before it is compared (on the reference's greedy
  continuation for a Parity), e.g. to refuse a fixture whose top-k selection sits on a tie.
- Variants of one family are named "family/variant"; `families.group("family")` gives a family
  file {variant: (ref, path, batch)}, built on access; `families.eager(name)` the shared eager model.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from tests.helpers import check_decode_equals_prefill, check_parity, save_reference


@dataclass(frozen=True)
class Parity:
    """Prefill of a [batch, length] prompt and `steps` greedy decode steps vs transformers."""
    length: int
    steps: int
    batch: Optional[int] = None  # default: the family's
    seed: Optional[int] = None  # default: from the check's position and length


@dataclass(frozen=True)
class DecodeEqualsPrefill:
    """Decoding tokens prompt_len.. of a [batch, length] sequence == one prefill of it. With
    greedy_from, the sequence is the reference's greedy continuation of a greedy_from-token prompt."""
    length: int
    prompt_len: int
    batch: Optional[int] = None
    seed: Optional[int] = None
    greedy_from: Optional[int] = None


@dataclass(frozen=True)
class Family:
    make: Callable[[], torch.nn.Module]
    eager: tuple = ()
    compiled: tuple = ()
    graphs: Optional[int] = None
    batch: int = 2
    max_seq: int = 48
    overrides: tuple[str, ...] = ()
    rtol: float = 1e-5
    save_kwargs: dict = field(default_factory=dict)
    save: Optional[Callable] = None  # (ref, path) -> None, instead of save_pretrained
    model_type: Optional[str] = None  # config.json's, asserted when given
    guard: Optional[Callable] = None
    after_compiled: Optional[Callable] = None
    hub: bool = False  # also loaded by Hub id from an offline local cache, in a fresh process

    def __post_init__(self):
        if self.compiled and self.graphs is None:
            raise ValueError("a family with compiled checks states its graph count (graphs=)")


def tiny_reference(model_cls, config, randomize: Optional[Callable] = None, seed: int = 0) -> torch.nn.Module:
    """model_cls(config) in float32 eval mode, seeded, then `randomize(model)`."""
    torch.manual_seed(seed)
    ref = model_cls(config).eval()
    if randomize is not None:
        randomize(ref)
    return ref


@torch.no_grad()
def randomize_norms(model: torch.nn.Module) -> None:
    """Norm weights away from 1 so that a misplaced one shows: a norm's own parameters only, not
    a linear's that a family keeps under a "norm" name (DBRX's attention under norm_attn_norm:
    U(0.5, 1.5) matrices there make q / k / v near-total cancellations)."""
    for owner, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            continue
        for name, p in module.named_parameters(prefix=owner, recurse=False):
            if "norm" in name:
                p.uniform_(0.5, 1.5)


def tokens(vocab: int, batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def greedy(ref, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """The reference's greedy continuation [B, L + steps] (what check_parity feeds back)."""
    seq = ids
    for _ in range(steps):
        seq = torch.cat((seq, ref(seq).logits[:, -1].argmax(-1)[:, None]), dim=1)
    return seq


def run_checks(family: Family, checks: tuple, ref, model) -> None:
    """The checks, in order, on `model` against `ref` (see the module docstring)."""
    vocab = ref.config.vocab_size
    for i, check in enumerate(checks):
        batch = check.batch or family.batch
        seed = check.seed if check.seed is not None else 100 * i + check.length
        if isinstance(check, Parity):
            ids = tokens(vocab, batch, check.length, seed)
            if family.guard is not None:
                family.guard(ref, model, greedy(ref, ids, check.steps))
            check_parity(ref, model, ids, steps=check.steps, rtol=family.rtol)
        elif isinstance(check, DecodeEqualsPrefill):
            if check.greedy_from is not None:
                seq = greedy(ref, tokens(vocab, batch, check.greedy_from, seed), check.length - check.greedy_from)
            else:
                seq = tokens(vocab, batch, check.length, seed)
            if family.guard is not None:
                family.guard(ref, model, seq)
            check_decode_equals_prefill(model, seq, prompt_len=check.prompt_len, rtol=family.rtol)
        else:
            raise TypeError(f"unknown check {check!r}")


class Families:
    """The table's references, checkpoints and eager zoo models, each built on first use and kept
    for the session; compiled models are built by the test that needs them (and dropped after)."""

    def __init__(self, table: Mapping[str, Family], tmp_path_factory):
        self.table = table
        self._tmp = tmp_path_factory
        self._refs: dict = {}
        self._eager: dict = {}

    def family(self, name: str) -> Family:
        if name not in self.table:
            raise KeyError(f"no family {name!r} in tests/test_family_parity.py's FAMILIES; have {sorted(self.table)}")
        return self.table[name]

    def reference(self, name: str):
        """(transformers model, checkpoint dir)."""
        if name not in self._refs:
            family = self.family(name)
            ref = family.make()
            path = self._tmp.mktemp(name.replace("/", "-"))
            if family.save is not None:
                family.save(ref, path)
            else:
                save_reference(ref, path, **family.save_kwargs)
            if family.model_type is not None:
                assert json.loads((path / "config.json").read_text())["model_type"] == family.model_type
            self._refs[name] = (ref, path)
        return self._refs[name]

    def load(self, name: str, compile: bool):
        import zoo

        family = self.family(name)
        _, path = self.reference(name)
        # compiled: one decode bucket, max_batch's (CI time: each bucket is one more decode graph per
        # layer kind; the buckets are tests/test_buckets.py's); eager runs the default buckets
        # and compiled regions, not runtime.aot's packages (tests/test_aot.py's)
        buckets = [f"runtime.decode_buckets=[{family.batch}]", "runtime.aot=false"] if compile else []
        return zoo.from_pretrained(str(path), compile=compile, max_batch=family.batch, max_seq=family.max_seq,
                                   overrides=[*family.overrides, *buckets])

    def eager(self, name: str):
        """The family's eager zoo model, shared for the session (its caches are per call)."""
        if name not in self._eager:
            self._eager[name] = self.load(name, compile=False)
        return self._eager[name]

    def group(self, prefix: str, with_batch: bool = True) -> "Group":
        return Group(self, prefix, with_batch)


class Group(Mapping):
    """{variant: (ref, path, batch)} (or (ref, path)) of the table's "prefix/variant" entries,
    each built on first access."""

    def __init__(self, families: Families, prefix: str, with_batch: bool = True):
        self._families, self._prefix, self._with_batch = families, prefix, with_batch
        self._names = [n.split("/", 1)[1] for n in families.table if n.startswith(prefix + "/")]

    def __getitem__(self, variant: str):
        name = f"{self._prefix}/{variant}"
        ref, path = self._families.reference(name)
        return (ref, path, self._families.family(name).batch) if self._with_batch else (ref, path)

    def __iter__(self):
        return iter(self._names)

    def __len__(self):
        return len(self._names)
