"""The web page `zoo serve` answers at / (a chat over /v1/chat/completions, the model card, live
/metrics) and the JSON its model card reads, GET /v1/zoo/card.

The page is plain HTML, CSS and JavaScript in zoo/serve/static/, shipped in the wheel as package
data: no build step, nothing fetched from elsewhere. The card is what `zoo build` and `zoo report`
say about the served model: the layer kinds (per layer, and per kind its parameters and cache
bytes), the exact parameter count, cache bytes per token, what quantization and the load kept
(stored block types), and the runner with its compiled graphs or packages.
"""
from __future__ import annotations

import time
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from ..compiler.analysis import analyze
from ..report import _by_outcome, _by_pattern, _layout_text, _RUNNER_TEXT, build_rows

ASSETS = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
          "style.css": "text/css; charset=utf-8"}


def _asset(name: str) -> bytes:
    return resources.files("zoo.serve").joinpath("static", name).read_bytes()


def model_card(model, name: str) -> dict[str, Any]:
    """The served model as plain data: the build's own figures (model.info: parameters, bytes,
    caches, quantization, load outcomes, runner) and, per layer kind, `zoo report`'s analysis of
    the spec at the served max_seq x max_batch. Under tensor / expert parallelism the build's
    figures are this rank's share, the analysis the whole model's."""
    spec, info, rt = model.spec, model.info, model.spec.runtime
    analysis = analyze(spec, context=rt.max_seq, batch=rt.max_batch, cache_dtype=rt.cache_dtype or rt.dtype,
                       weight_dtype=rt.dtype)
    quant = None
    if info.quant is not None:
        q = info.quant
        quant = {"mode": q.mode, "group": q.group, "kernel": q.kernel, "summary": q.summary(),
                 "linears": len(q.quantized), "quantized_params": q.quantized_params, "float_params": q.float_params,
                 "kept_float": _by_pattern(q.kept_float)}
    load = None
    if info.load is not None:
        load = {"tensors_read": info.load.tensors_read, "bytes_read": info.load.bytes_read,
                "seconds": info.load.seconds, "weight_cache": info.load.cache,
                # "kept Q4_1 blocks as int4 g32" / "BF16 -> float32": how many stored tensors each
                "outcomes": {what: len(names) for what, names in _by_outcome(info.load.tensors).items()},
                "ignored": len(info.load.ignored)}
    return {
        "id": name, "config": spec.name, "source": spec.source,
        "n_layers": spec.n_layers, "layout": _layout_text(spec.layout_runs()),
        "layers": [{"kind": f"{x.mixer_name}+{x.ffn_name}", "mixer": x.mixer.kind, "ffn": x.ffn.kind}
                   for x in spec.layers],
        "kinds": [{k: kind[k] for k in ("name", "mixer", "ffn", "layers", "params_per_layer", "active_per_layer",
                                         "cache_bytes_per_token", "state_bytes_per_sequence")}
                  for kind in analysis["kinds"]],
        "cache_fields": analysis["cache_fields"],
        "params": info.params, "params_active": analysis["params_active"], "param_bytes": info.param_bytes,
        "dtype": rt.dtype, "cache_dtype": rt.cache_dtype or rt.dtype,
        "cache_bytes_per_token": info.cache_bytes_per_token, "state_bytes_per_sequence": info.state_bytes_per_sequence,
        "cache_bytes": info.cache_bytes, "max_seq": rt.max_seq, "max_batch": rt.max_batch,
        "decode_flops_per_token": analysis["decode_flops_per_token"],
        "device": info.device, "parallel": info.parallel,
        "quant": quant, "load": load,
        "runner": info.runner, "runner_text": _RUNNER_TEXT.get(info.runner, info.runner),
        "compile_seconds": info.compile_seconds,
        "decode_buckets": list(model.engine.buckets),
        "report": [list(row) for row in build_rows(model)],  # `zoo build`'s table, row by row
    }


def _graph_counts(engine) -> dict[str, int]:
    """The engine's graphs (or packages) now: the scheduler thread may add one while this reads
    its runner's tables, which then raise; read again."""
    for _ in range(5):
        try:
            return engine.graph_counts()
        except RuntimeError:  # a dict changed size during iteration
            time.sleep(0.01)
    return engine.graph_counts()


def add_routes(app: FastAPI, server) -> None:
    """GET / (the page), GET /static/NAME (its assets), GET /v1/zoo/card (the model card, behind
    the API key like /v1/models). Call before the scheduler thread starts: the card's analysis
    builds the spec on the meta device."""
    card = model_card(server.model, server.name)
    assets = {name: _asset(name) for name in ASSETS}
    no_cache = {"Cache-Control": "no-cache"}

    @app.get("/", include_in_schema=False)
    async def index():
        return Response(assets["index.html"], media_type=ASSETS["index.html"], headers=no_cache)

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str):
        if name not in assets:
            # the app's handler answers it as an OpenAI error object (code not_found)
            raise HTTPException(404, f"no static file {name!r}; the page's files are {sorted(assets)}")
        return Response(assets[name], media_type=ASSETS[name], headers=no_cache)

    @app.get("/v1/zoo/card")
    async def zoo_card(request: Request):
        server.check_auth(request)
        return {**card, "graphs": _graph_counts(server.model.engine), "running": server.scheduler.running,
                "waiting": server.scheduler.queue_depth}
