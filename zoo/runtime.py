"""The user API: `build` (a conf), `from_pretrained` (a checkpoint) and the Model they return.

    conf / config.json -> composed config -> compiler/build.py's stages (spec, cast, quant, shard,
      precision, count, cache, fit, load, weights, runner, engine) -> Model
"""
from __future__ import annotations

import json
from typing import Callable, Optional, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from .compiler.build import BuildRecords, BuildReport, check_source, report_from, run_build
from .compiler.checkpoint.hub import open_source
from .compiler.config import apply_overrides, compose
from .compiler.errors import InputError
from .compiler.engine.core import Engine
from .compiler.engine.drafters import Pick
from .compiler.engine.speculative import Speculator, make_speculator
from .compiler.hf_import import import_config
from .compiler.model import Decoder
from .compiler.spec import ModelSpec

from .sampling import probabilities, sample

class Model:
    """A built model: `prefill`, `decode`, `reset`, `generate`. See README for the API."""

    def __init__(self, spec: ModelSpec, module: Decoder, engine: Engine, records: BuildRecords,
                 eos_ids: Sequence[int] = (), tokenizer=None):
        self.spec, self.module, self.engine = spec, module, engine
        self.records = records  # what each build stage decided (compiler/build.py)
        self.info: BuildReport = report_from(records)
        self.eos_ids = sorted(set(eos_ids))
        self.tokenizer = tokenizer
        self._grammars = None  # zoo.constrain.Grammars, made on the first constrained generate
        self._speculators: dict[tuple, Speculator] = {}

    @property
    def config(self) -> DictConfig:
        return self.spec.config

    def prefill(self, ids: torch.Tensor, return_mtp: bool = False, last_only: bool = False):
        """ids [B, L] -> logits [B, L, V] (float32; [B, 1, V] with last_only); starts a new batch.

        return_mtp: (logits, mtp) with the multi-token-prediction layers' next-next-token logits,
        mtp[k-1] [B, L - k, V] for token t + k + 1 at position t (needs checkpoint.mtp=true).
        """
        return self.engine.prefill(torch.as_tensor(ids), return_mtp=return_mtp, last_only=last_only)

    def decode(self, tok: torch.Tensor) -> torch.Tensor:
        """tok [B] -> logits [B, V] for the next position of each sequence."""
        return self.engine.decode(torch.as_tensor(tok))

    def reset(self) -> None:
        """Clear every cache for a new batch."""
        self.engine.reset()

    def grammar(self, response_format=None, grammar: Optional[str] = None):
        """The compiled output constraint of generate(response_format=, grammar=) (zoo.constrain),
        or None. response_format: a JSON schema (dict), a pydantic model class, or the OpenAI
        shapes {"type": "json_object"} / {"type": "json_schema", "json_schema": {"schema": ...}};
        grammar: Lark or GBNF text. GrammarError naming the argument when it cannot be used."""
        from .constrain import GrammarError, Grammars

        if response_format is not None and grammar is not None:
            raise GrammarError("grammar", "give response_format or grammar, not both")
        if response_format is None and grammar is None:
            return None
        if self.tokenizer is None:
            raise InputError("generate(response_format=/grammar=) needs the model's tokenizer, and this "
                             "checkpoint has none")
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.engine.vocab_size,
                                      set(self.eos_ids) | self.tokenizer.eos_ids)
        if grammar is not None:
            return self._grammars.get("grammar", grammar, "grammar")
        schema = response_format
        if isinstance(schema, type) and hasattr(schema, "model_json_schema"):  # a pydantic model
            schema = _strict(schema.model_json_schema())
        elif isinstance(schema, dict) and schema.get("type") == "json_object":
            schema = {"type": "object"}
        elif isinstance(schema, dict) and schema.get("type") == "json_schema":
            schema = (schema.get("json_schema") or {}).get("schema")
        return self._grammars.get("json_schema", schema, "response_format")

    def speculator(self, drafter: Optional[str] = None, draft_tokens: Optional[int] = None) -> Optional[Speculator]:
        """The speculative decoder generate uses (compiler/engine/speculative.py): drafter "ngram"
        | "mtp" | "off", draft_tokens Kd; None takes runtime.speculative's. None when off. Its
        `stats` count drafted and accepted tokens over every generate call that used it."""
        cfg = self.spec.runtime.speculative
        name = cfg.drafter if drafter is None else drafter
        if name in (None, "off"):
            return None
        kd = cfg.draft_tokens if draft_tokens is None else int(draft_tokens)
        key = (name, kd, cfg.ngram_max, cfg.ngram_min)
        if key not in self._speculators:
            self._speculators[key] = make_speculator(self.engine, name, kd, cfg.ngram_max, cfg.ngram_min)
        return self._speculators[key]

    @torch.no_grad()
    def generate(self, ids, max_new_tokens: int, temperature: float = 0.0, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, generator: Optional[torch.Generator] = None,
                 stream: Optional[Callable[[torch.Tensor], None]] = None,
                 eos_ids: Optional[Sequence[int]] = None, response_format=None,
                 grammar: Optional[str] = None, speculative: Optional[str] = None,
                 draft_tokens: Optional[int] = None) -> torch.Tensor:
        """ids [B, L] -> [B, L + n] with n <= max_new_tokens new tokens per row.

        A row stops at an end token (kept, then padded with it); generation ends when every row
        has stopped, after max_new_tokens, or when the cache is full. `stream` gets each step's
        tokens [B] as they are chosen.

        response_format / grammar (see `grammar()`): every row's new tokens follow it (each row
        its own state); a row whose output is complete ends with an end token. A row that runs
        out of max_new_tokens first is cut there, incomplete.

        speculative: "ngram" | "mtp" drafts draft_tokens tokens per step and verifies them in one
        (compiler/engine/speculative.py): greedy output is the same tokens, sampled output the
        same distribution; "off" decodes plainly; None (default) follows runtime.speculative.
        With a constraint the drafts are cut at the first token the grammar rejects and each
        verified position is masked by the grammar: the same tokens as constrained plain greedy
        decoding, the same distribution sampled.
        """
        ids = torch.as_tensor(ids)
        if ids.dim() == 1:
            ids = ids[None]
        compiled = self.grammar(response_format, grammar)
        rows = [compiled.constraint() for _ in range(ids.shape[0])] if compiled is not None else None
        eos = torch.tensor(self.eos_ids if eos_ids is None else sorted(set(eos_ids)), dtype=torch.long,
                           device=self.engine.device)
        if rows is not None:
            if not eos.numel():
                raise InputError("generate(response_format=/grammar=) needs an end token to end a complete "
                                 "output: the checkpoint names none (pass eos_ids=)")
            # where the grammar may end it admits the tokenizer's end tokens too: they end the row
            eos = torch.cat((eos, torch.tensor(sorted(self.tokenizer.eos_ids), dtype=torch.long, device=eos.device)))
        spec = self.speculator(speculative, draft_tokens)
        if spec is not None:
            return self._generate_speculative(spec, ids, max_new_tokens, temperature, top_k, top_p, generator,
                                              stream, eos.tolist(), rows)
        logits = self.engine.prefill(ids, last_only=True)[:, -1]
        steps = min(max_new_tokens, self.engine.max_seq - ids.shape[1] + 1)
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=self.engine.device)
        out = []
        for step in range(steps):
            if rows is not None:
                # a complete row takes only an end token (the end of generate's eos_ids)
                logits = torch.stack([
                    logits[b] if done[b] else
                    torch.full_like(logits[b], float("-inf")).index_fill(0, eos[:1], 0.0) if c.done else
                    c.apply(logits[b]) for b, c in enumerate(rows)])
            tok = sample(logits, temperature, top_k, top_p, generator)
            if rows is not None:
                ends = set(eos.tolist())
                for b, c in enumerate(rows):
                    t = int(tok[b])
                    if not done[b] and not c.done and t not in ends and not c.accept(t):
                        raise InputError(f"row {b}: the grammar rejected token {t}: {c.error}")
            if out:
                tok = torch.where(done, out[-1], tok)
            out.append(tok)
            if stream is not None:
                stream(tok)
            done |= torch.isin(tok, eos)
            if step == steps - 1 or bool(done.all()):
                break
            logits = self.engine.decode(tok)
        new = torch.stack(out, dim=1) if out else ids.new_zeros((ids.shape[0], 0))
        return torch.cat((ids.to(new.device), new), dim=1)

    def _generate_speculative(self, spec: Speculator, ids: torch.Tensor, max_new_tokens: int, temperature: float,
                              top_k, top_p, generator, stream, eos: list[int], constraints=None) -> torch.Tensor:
        """generate through speculative rounds over rows 0..B-1 (each row at its own length).
        eos: the end tokens, eos[0] the one a complete constrained row ends with; constraints:
        one zoo.constrain.Constraint per row, or None."""
        e = self.engine
        B, L = ids.shape
        if B > e.max_batch:
            raise InputError(f"generate: batch {B} must be in 1..max_batch={e.max_batch} "
                             f"(rebuild with runtime.max_batch={B})")
        steps = min(max_new_tokens, e.max_seq - L + 1)
        ids = ids.to(torch.long)
        if steps <= 0:
            return ids
        spec.reset()
        logits = spec.prefill_rows(0, ids)
        if constraints is not None:
            logits = torch.stack([c.apply(lg) for c, lg in zip(constraints, logits)])
        first = sample(logits, temperature, top_k, top_p, generator).cpu()
        probs = None if temperature == 0 else lambda lg: probabilities(lg, temperature, top_k, top_p)
        picks = [Pick(probs, generator, None if constraints is None else constraints[i]) for i in range(B)]
        ends = set(eos)
        out, done, history = [[] for _ in range(B)], [False] * B, [ids[i].cpu() for i in range(B)]

        def take(i: int, toks: list[int]) -> None:
            """Row i's tokens from a round: cut after an end token; a constrained row's grammar
            follows them, and once complete the row gets the end token plain decoding gives it."""
            c = picks[i].constraint
            for j, t in enumerate(toks):
                if t in ends:
                    toks = toks[:j + 1]
                    break
                if c is not None and not c.accept(t):
                    raise InputError(f"row {i}: the grammar rejected token {t}: {c.error}")
                if c is not None and c.done:
                    toks = toks[:j + 1] + eos[:1]
                    break
            toks = toks[:steps - len(out[i])]
            out[i] += toks
            history[i] = torch.cat((history[i], torch.tensor(toks, dtype=torch.long)))
            done[i] = toks[-1] in ends or len(out[i]) >= steps

        for i in range(B):
            take(i, [int(first[i])])
        streamed = 0

        def flush():
            nonlocal streamed
            while all(streamed < len(o) or d for o, d in zip(out, done)) and streamed < max(map(len, out)):
                col = [o[streamed] if streamed < len(o) else o[-1] for o in out]
                stream(torch.tensor(col, device=e.device))
                streamed += 1

        if stream is not None:
            flush()
        while not all(done):
            rows = [i for i in range(B) if not done[i]]
            results = spec.step(rows, [history[i] for i in rows], [picks[i] for i in rows])
            for i, res in zip(rows, results):
                if res.error is not None:
                    raise InputError(f"row {i}: {res.error}")
                take(i, res.tokens)
            if stream is not None:
                flush()
        n = max(map(len, out))
        new = torch.tensor([o + [o[-1]] * (n - len(o)) for o in out], dtype=torch.long)
        return torch.cat((ids.cpu(), new), dim=1).to(e.device)


def _strict(schema):
    """A pydantic model's JSON schema made strict as OpenAI's structured outputs make it: an
    object takes no properties its model does not declare (pydantic's default admits any)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_strict(v) for v in schema]
    return schema


# --------------------------------------------------------------------------- building

def _runtime_overrides(cfg: DictConfig, **kw) -> None:
    for key, value in kw.items():
        if value is None:
            continue
        if key in ("dtype", "cache_dtype") and isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        if key == "device":
            value = str(value)
        OmegaConf.update(cfg, f"runtime.{key}", value, merge=False)


def build_from_config(cfg: DictConfig, source_desc: str, weights=None, *, seed: int = 0,
                      dry: Optional[bool] = None, progress: bool = False, eos_ids: Sequence[int] = (),
                      tokenizer=None) -> Model:
    """Run the build stages (compiler/build.py) on a composed config and wrap the result.

    weights: a checkpoint Source, a path or repo id, or None (random weights). dry: None builds
    for real when it fits and raises otherwise; True always builds on the meta device (report +
    shape check of both graphs); False raises when it does not fit.
    """
    source = None if weights is None else check_source(weights, source_desc)
    records = run_build(cfg, source_desc, source, seed=seed, dry=dry,
                        progress=_progress_bar if progress else None)
    return Model(records.spec.spec, records.weights.module, records.engine.engine, records,
                 eos_ids=eos_ids, tokenizer=tokenizer)


def shape_check(model: Model) -> dict[str, tuple[int, ...]]:
    """Run both graphs once (on meta for dry builds) and return their output shapes."""
    e = model.engine
    L = min(4, e.max_seq)
    ids = torch.zeros(e.max_batch, L, dtype=torch.long, device=e.device)
    prefill = tuple(e.prefill(ids).shape)
    decode = tuple(e.decode(torch.zeros(e.max_batch, dtype=torch.long, device=e.device)).shape) \
        if e.max_seq > L else None
    e.reset()
    return {"prefill": prefill, "decode": decode}


def _progress_bar(total: int):
    """A progress bar on stderr for `total` bytes; returns the callback that advances it."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    # on stderr: stdout carries only what the command prints (`zoo generate`'s text, pipeable)
    bar = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                   TimeRemainingColumn(), transient=True, console=Console(stderr=True))
    task = bar.add_task("loading weights", total=total)
    bar.start()

    def advance(n: int) -> None:
        bar.advance(task, n)
        if bar.tasks[task].completed >= total:
            bar.stop()
    return advance


def build(conf_name: str, overrides: Sequence[str] = (), weights=None, *, device=None, dtype=None,
          compile: Optional[bool] = None, max_batch: Optional[int] = None, max_seq: Optional[int] = None,
          cache_dtype=None, seed: int = 0, dry: Optional[bool] = False, progress: bool = False,
          quant: Optional[str] = None, quant_group: Optional[int] = None) -> Model:
    """Build conf/NAME.yaml (with Hydra overrides).

    quant: "int8" | "int4" weight-only quantization (quant_group 32 | 64 | 128 for int4), i.e.
    runtime.quant / runtime.quant_group.
    weights: a checkpoint (directory, .gguf file, Hub repo id, pkg://PACKAGE/FILE). None loads the
    config's `checkpoint.weights` when it names some (except for dry builds, which read no
    weights) and random weights otherwise; `checkpoint.weights=null` forces random weights.
    """
    cfg = compose(conf_name, overrides)
    _runtime_overrides(cfg, device=device, dtype=dtype, compile=compile, max_batch=max_batch,
                       max_seq=max_seq, cache_dtype=cache_dtype, quant=quant, quant_group=quant_group)
    source_desc = f"conf/{conf_name}.yaml" + (f" (overrides {list(overrides)})" if overrides else "")
    if weights is None and dry is not True:
        weights = OmegaConf.select(cfg, "checkpoint.weights", default=None)
    eos, tok = (), None
    if weights is not None:
        source = check_source(weights, source_desc)
        eos = _eos_ids(source.config(), source)
        tok = load_tokenizer_for(source)
        weights = source
    return build_from_config(cfg, source_desc, weights, seed=seed, dry=dry, progress=progress,
                             eos_ids=eos, tokenizer=tok)


def from_pretrained(path_or_repo_id: str, device="cpu", dtype=torch.float32, compile: bool = True,
                    max_batch: int = 1, max_seq: Optional[int] = None, revision: Optional[str] = None,
                    overrides: Sequence[str] = (), cache_dtype=None, progress: bool = False,
                    quant: Optional[str] = None, quant_group: Optional[int] = None,
                    quant_prefill: Optional[str] = None, memory_limit: Optional[int] = None,
                    force_load: Optional[bool] = None) -> Model:
    """Load a checkpoint (directory, .gguf file, or Hub repo id) with the config it describes.

    max_seq defaults to the model's context length, capped at 4096. quant: "int8" | "int4"
    weight-only quantization at load (quant_group 32 | 64 | 128 for int4); a GGUF file's
    blocks stay as stored (linears and expert stacks, on zoo's CPU kernels; int4 needs group 32).
    quant_prefill: runtime.quant_prefill ("float": many-row calls on float GEMMs, giving up the
    batch-invariant int8 numerics of the default).
    memory_limit: runtime.memory_limit, the bytes the weights and caches may hold (None:
    $ZOO_MEMORY_LIMIT, else the memory available); a checkpoint past it is refused, naming the
    sizes, before any weight is read, unless force_load=True.
    """
    return from_pretrained_config(path_or_repo_id, overrides, revision=revision, dry=False, progress=progress,
                                  device=device, dtype=dtype, compile=compile, max_batch=max_batch,
                                  max_seq=max_seq, cache_dtype=cache_dtype, quant=quant, quant_group=quant_group,
                                  quant_prefill=quant_prefill, memory_limit=memory_limit, force_load=force_load)


def from_pretrained_config(path_or_repo_id: str, overrides: Sequence[str] = (), *, revision=None,
                           dry: Optional[bool] = False, progress: bool = False, **runtime) -> Model:
    """from_pretrained with config overrides (`runtime.max_seq=512`, ...) applied to the imported config."""
    source = open_source(str(path_or_repo_id), revision=revision)
    config = source.config()
    cfg = import_config(config, source.description)
    cfg.runtime.max_seq = min(int(cfg.max_position), 4096)
    if overrides:
        cfg = apply_overrides(cfg, overrides, source.description)
    _runtime_overrides(cfg, **runtime)
    return build_from_config(cfg, source.description, source, dry=dry, progress=progress,
                             eos_ids=_eos_ids(config, source), tokenizer=load_tokenizer_for(source))


def load_tokenizer_for(source):
    """The checkpoint's tokenizer (GGUF metadata, or tokenizer.json in the directory), if any."""
    from .compiler.checkpoint.gguf import GGUFSource
    from .compiler.checkpoint.safetensors_source import SafetensorsSource

    from .tokenizer import Tokenizer

    if isinstance(source, GGUFSource):
        # a file without tokenizer metadata still loads (ids in, logits out)
        return Tokenizer.from_gguf(source) if source.metadata("tokenizer.ggml.model") is not None else None
    if isinstance(source, SafetensorsSource) and (source.directory / "tokenizer.json").exists():
        return Tokenizer.from_dir(source.directory)
    return None


def _eos_ids(config: dict, source=None) -> list[int]:
    """Every end token: config.json's (or GGUF metadata's) eos_token_id, an int or a list, plus a
    checkpoint directory's generation_config.json eos_token_id (Llama 3 ends chat turns with
    <|eot_id|>, listed only there; a GGUF file has no directory)."""
    from .compiler.checkpoint.safetensors_source import SafetensorsSource

    found = []
    gen = source.directory / "generation_config.json" if isinstance(source, SafetensorsSource) else None
    for eos in (config.get("eos_token_id"),
                json.loads(gen.read_text()).get("eos_token_id") if gen is not None and gen.is_file() else None):
        if eos is not None:
            found += [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return sorted(set(found))


__all__ = ["Model", "build", "from_pretrained", "build_from_config", "shape_check", "InputError"]
