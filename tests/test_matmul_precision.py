"""bfloat16 on CPUs without native bfloat16 GEMMs (compiler/matmul_precision.py): many-token
products in float32, one-token rows in bfloat16, weights untouched; a built model says so."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import zoo
from zoo.report import build_rows
from zoo.compiler.matmul_precision import Float32ProductLinear, native_bfloat16, upcast_products


def test_many_token_products_are_float32_and_one_token_rows_bfloat16():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    lin.__class__ = Float32ProductLinear
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    out = lin(x)
    assert out.dtype == torch.bfloat16 and torch.equal(lin.weight, w)
    assert torch.equal(out, F.linear(x.float(), w.float(), b.float()).bfloat16())
    step = x[:, :1]
    assert torch.equal(lin(step), F.linear(step, w, b))  # the bfloat16 product itself


def test_applied_only_without_native_bfloat16():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    changed = upcast_products(model, torch.bfloat16, torch.device("cpu"))
    assert changed == (0 if native_bfloat16() else 2)
    assert upcast_products(nn.Sequential(nn.Linear(8, 8)), torch.float32, torch.device("cpu")) == 0


def test_built_bfloat16_model_reports_and_matches_float32_products():
    m = zoo.build("llama3_8b_tiny", compile=False, max_batch=1, max_seq=16, dtype=torch.bfloat16)
    n = sum(type(mod) is Float32ProductLinear for mod in m.module.modules())
    assert m.info.float32_products == n == (0 if native_bfloat16() else n)
    rows = dict(build_rows(m))
    assert ("float32" in rows["weights"]) == (n > 0)
