"""Build pipeline and the user-facing Model.

    spec (conf or config.json) -> modules on meta -> memory check -> materialize -> weights
      (checkpoint rules, or random init) -> Engine (caches + prefill/decode graphs) -> Model
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from .compiler.checkpoint.hub import open_source
from .compiler.checkpoint.loader import LoadReport, execute, plan_load
from .compiler.checkpoint.rules import checkpoint_stages
from .compiler.checkpoint.weight_cache import cached_execute
from .compiler.config import apply_overrides, compose
from .compiler.errors import InputError, ZooError
from .compiler.engine.core import Engine
from .compiler.hf_import import import_config
from .compiler.model import (Decoder, build_model, cast, count_parameters, materialize, parameter_bytes,
                            torch_dtype)
from .compiler.matmul_precision import upcast_products
from .compiler.quant.apply import QuantReport, compute_dtype_for, fill_tied, quantize_linears, quantized_bytes
from .compiler.quant.experts import QuantExperts
from .compiler.quant.linear import QuantLinear
from .compiler.spec import ModelSpec, use_aot, validate

from .sampling import sample

def available_memory(device: torch.device) -> int:
    """Bytes free for new allocations on `device`."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "meta":
        return 1 << 62
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass
class BuildInfo:
    params: int
    param_bytes: int
    cache_bytes: int
    cache_bytes_per_token: int
    state_bytes_per_sequence: int
    available_bytes: int
    device: str
    dry: bool
    compile_seconds: dict = field(default_factory=dict)
    load: Optional[LoadReport] = None
    load_seconds: float = 0.0
    parallel: Optional[dict] = None  # tp, ep, rank, size, head: this rank's share (params are per rank)
    quant: Optional[QuantReport] = None  # which linears are quantized, what stays float and why
    float32_products: int = 0  # bfloat16 linears whose many-token products run in float32 (matmul_precision)

    @property
    def needed_bytes(self) -> int:
        return self.param_bytes + self.cache_bytes


class Model:
    """A built model: `prefill`, `decode`, `reset`, `generate`. See README for the API."""

    def __init__(self, spec: ModelSpec, module: Decoder, engine: Engine, info: BuildInfo,
                 eos_ids: Sequence[int] = (), tokenizer=None):
        self.spec, self.module, self.engine, self.info = spec, module, engine, info
        self.eos_ids = sorted(set(eos_ids))
        self.tokenizer = tokenizer

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

    @torch.no_grad()
    def generate(self, ids, max_new_tokens: int, temperature: float = 0.0, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, generator: Optional[torch.Generator] = None,
                 stream: Optional[Callable[[torch.Tensor], None]] = None,
                 eos_ids: Optional[Sequence[int]] = None) -> torch.Tensor:
        """ids [B, L] -> [B, L + n] with n <= max_new_tokens new tokens per row.

        A row stops at an end token (kept, then padded with it); generation ends when every row
        has stopped, after max_new_tokens, or when the cache is full. `stream` gets each step's
        tokens [B] as they are chosen.
        """
        ids = torch.as_tensor(ids)
        if ids.dim() == 1:
            ids = ids[None]
        eos = torch.tensor(self.eos_ids if eos_ids is None else sorted(set(eos_ids)), dtype=torch.long,
                           device=self.engine.device)
        logits = self.engine.prefill(ids, last_only=True)[:, -1]
        steps = min(max_new_tokens, self.engine.max_seq - ids.shape[1] + 1)
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=self.engine.device)
        out = []
        for step in range(steps):
            tok = sample(logits, temperature, top_k, top_p, generator)
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
    """Validate, build on meta, check memory, materialize, load or init, make the engine.

    dry: None builds for real when it fits and raises otherwise; True always builds on the meta
    device (report + shape check of both graphs); False raises when it does not fit.
    """
    spec = validate(cfg, source=source_desc)
    rt = spec.runtime
    device = torch.device(rt.device)
    dtype, cache_dtype = torch_dtype(rt.dtype), torch_dtype(rt.cache_dtype or rt.dtype)
    meta_model = cast(build_model(spec), dtype)
    if weights is not None and not hasattr(weights, "entries"):
        weights = open_source(str(weights))
    # quantized before it is sharded: every rank quantizes the linears one process would
    quant = quantize_linears(meta_model, rt.quant, rt.quant_group, compute_dtype_for(device, dtype),
                             device=device) if rt.quant else None
    mesh, slices = _shard(spec, meta_model, weights)
    # bfloat16 on a CPU without native bfloat16 GEMMs: many-token products in float32
    float32_products = upcast_products(meta_model, dtype, mesh.device if mesh is not None else device)
    if mesh is not None:
        device = mesh.device
    params = count_parameters(meta_model) + sum(m.in_features * m.out_features for m in meta_model.modules()
                                                if isinstance(m, QuantLinear) and not m.tied_to) \
        + sum(m.numel() for m in meta_model.modules() if isinstance(m, QuantExperts))
    param_bytes = parameter_bytes(meta_model) + quantized_bytes(meta_model)
    from .compiler.engine.cache import plan_caches

    plan = plan_caches(meta_model, rt.max_batch, rt.max_seq, cache_dtype)
    info = BuildInfo(params=params, param_bytes=param_bytes, cache_bytes=plan.total_bytes(),
                     cache_bytes_per_token=plan.bytes_per_token(),
                     state_bytes_per_sequence=plan.state_bytes_per_sequence(),
                     available_bytes=available_memory(device), device=str(device), dry=False, quant=quant,
                     float32_products=float32_products)
    if mesh is not None:
        info.parallel = {"tp": mesh.tp, "ep": mesh.ep, "rank": mesh.rank, "size": mesh.size, "head": slices[1]}
    fits = info.needed_bytes <= info.available_bytes
    if dry is None:
        dry = not fits and weights is None
    if dry:
        return _dry_model(spec, meta_model, info, cache_dtype)
    if not fits:
        raise ZooError(f"{spec.name}: needs {info.needed_bytes / 2**30:.2f} GiB ({params:,} parameters in "
                       f"{rt.dtype} + {info.cache_bytes / 2**30:.2f} GiB of caches) but {device} has "
                       f"{info.available_bytes / 2**30:.2f} GiB available; nothing was allocated")

    source = None
    if weights is not None:
        source = weights if hasattr(weights, "entries") else open_source(str(weights))
        load_plan = plan_load(meta_model, source, checkpoint_stages(source, spec),  # every check before allocating
                              slices=slices[0] if mesh is not None else None)
    t0 = time.perf_counter()
    module = materialize(meta_model, device, dtype)
    if mesh is not None:
        module.shard_slices = slices[0]  # {parameter: parallel.plan.Slice}: what this rank holds
    if source is not None:
        # converted weights (GGUF dequantized or repacked, quantized at load) come from the
        # weight cache after the first load (compiler/checkpoint/weight_cache.py); not per rank
        settings = {"dtype": rt.dtype, "quant": rt.quant, "quant_group": rt.quant_group, "device": str(device)}
        info.load = cached_execute(load_plan, module, source, settings, enabled=mesh is None,
                                   progress=_progress_bar(load_plan.bytes_to_read, progress),
                                   row_absmax=None if mesh is None else mesh.max_over_ranks)
    else:
        # drawn where the weights live: an 8B model on a GPU never passes through host memory
        # (the numbers depend on the device's generator; the same seed repeats on one device)
        module.init_weights(torch.Generator(device=device).manual_seed(seed))
        fill_tied(module)
    info.load_seconds = time.perf_counter() - t0
    engine = Engine(module, max_batch=rt.max_batch, max_seq=rt.max_seq, cache_dtype=cache_dtype,
                    compile=rt.compile, cuda_graph=rt.cuda_graph, aot=use_aot(rt))
    if rt.compile or engine.use_cuda_graph:
        info.compile_seconds = engine.warmup()
    return Model(spec, module, engine, info, eos_ids=eos_ids, tokenizer=tokenizer)


def _shard(spec: ModelSpec, meta_model: Decoder, weights):
    """Under runtime.parallel: the mesh (creating the process group from torchrun's environment),
    a check that every rank builds the same config from the same checkpoint, and the model on
    meta cut to this rank's share. (None, None) for a single process."""
    from .compiler.parallel.mesh import check_same_on_all_ranks, setup
    from .compiler.parallel.plan import shard_model

    par = spec.runtime.parallel
    mesh = setup(par.tp, par.ep, spec.runtime.device, spec.source)
    if mesh is None:
        return None, None
    check_same_on_all_ranks(mesh, "the config", OmegaConf.to_yaml(spec.config, resolve=True))
    if weights is not None and hasattr(weights, "entries"):
        headers = sorted((n, tuple(i.shape), i.dtype, i.nbytes) for n, i in weights.entries().items())
        check_same_on_all_ranks(mesh, f"the checkpoint ({weights.description})", repr(headers))
    report = shard_model(meta_model, mesh)
    return mesh, (report.slices, report.head)


def _dry_model(spec: ModelSpec, meta_model: Decoder, info: BuildInfo, cache_dtype) -> Model:
    """A model on the meta device: the report plus a shape check of both graphs."""
    info.dry, info.device = True, "meta"
    rt = spec.runtime
    engine = Engine(meta_model, max_batch=rt.max_batch, max_seq=rt.max_seq, cache_dtype=cache_dtype,
                    compile=False, cuda_graph=False)
    return Model(spec, meta_model, engine, info)


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


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
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
        source = open_source(str(weights))
        eos = _eos_ids(source.config(), source)
        tok = load_tokenizer_for(source)
        weights = source
    return build_from_config(cfg, source_desc, weights, seed=seed, dry=dry, progress=progress,
                             eos_ids=eos, tokenizer=tok)


def from_pretrained(path_or_repo_id: str, device="cpu", dtype=torch.float32, compile: bool = True,
                    max_batch: int = 1, max_seq: Optional[int] = None, revision: Optional[str] = None,
                    overrides: Sequence[str] = (), cache_dtype=None, progress: bool = False,
                    quant: Optional[str] = None, quant_group: Optional[int] = None) -> Model:
    """Load a checkpoint (directory, .gguf file, or Hub repo id) with the config it describes.

    max_seq defaults to the model's context length, capped at 4096. quant: "int8" | "int4"
    weight-only quantization at load (quant_group 32 | 64 | 128 for int4); a GGUF file's Q4_0 /
    Q4_1 blocks stay as stored under int4 with group 32.
    """
    return from_pretrained_config(path_or_repo_id, overrides, revision=revision, dry=False, progress=progress,
                                  device=device, dtype=dtype, compile=compile, max_batch=max_batch,
                                  max_seq=max_seq, cache_dtype=cache_dtype, quant=quant, quant_group=quant_group)


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
    <|eot_id|>, listed only there)."""
    found = []
    directory = getattr(source, "directory", None)
    gen = directory / "generation_config.json" if directory is not None else None
    for eos in (config.get("eos_token_id"),
                json.loads(gen.read_text()).get("eos_token_id") if gen is not None and gen.is_file() else None):
        if eos is not None:
            found += [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return sorted(set(found))


__all__ = ["Model", "build", "from_pretrained", "build_from_config", "shape_check", "InputError"]
