"""Structured output (zoo.constrain, llguidance): grammars compiled once per tokenizer and cached,
per-row masks in the scheduler's sampling step beside unconstrained rows, and `zoo serve`'s
response_format json_object / json_schema plus extra_body regex / grammar / choice through the
official openai client (incl. chat.completions.parse with a pydantic model), bad constraints as
400s naming the field; a batch of schemas on real SmolLM2 weights, every output validated with
jsonschema; constrained rows under speculative decoding (drafts cut where the grammar
rejects them, verified positions masked): the same tokens as plain constrained decoding. Eager models
only (no compile)."""
from __future__ import annotations

import dataclasses
import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import pytest
import torch

import zoo
from tests.serve_fixtures import running_server, write_tiny_llama
from zoo.constrain import GrammarError, Grammars
from zoo.serve.scheduler import SamplingParams, Scheduler, Sequence

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytest.importorskip("transformers")

NAME, KEY = "tiny", "sk-structured"

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "role", "tags", "address"], "additionalProperties": False}
POINT = {"type": "object", "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1},
                                          "y": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9}},
         "required": ["x", "y"], "additionalProperties": False}
FLAGS = {"type": "object", "properties": {"ok": {"type": "boolean"}, "level": {"enum": [1, 2, 3]},
                                          "items": {"type": "array", "items": POINT, "maxItems": 2}},
         "required": ["ok", "level", "items"], "additionalProperties": False}
SCHEMAS = [PERSON, POINT, FLAGS, {"type": "array", "items": {"enum": ["red", "green"]}, "minItems": 2, "maxItems": 4}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("structured") / "ckpt")


@pytest.fixture(scope="module")
def model(ckpt):
    return zoo.from_pretrained(str(ckpt), compile=False, max_batch=4, max_seq=256)


@pytest.fixture(scope="module")
def grammars(model):
    return Grammars(model.tokenizer, model.engine.vocab_size, Scheduler(model).eos)


def _run(model, specs):
    """specs: [(prompt text, SamplingParams)] -> [(text, finish_reason)], all in one scheduler."""
    sched, out = Scheduler(model), {}
    seqs = []
    for i, (prompt, params) in enumerate(specs):
        out[i] = []
        seqs.append(Sequence(model.tokenizer.encode(prompt), params, out[i].append, tokenizer=model.tokenizer))
    sched.submit(seqs)
    while sched.step():
        pass
    return ["".join(ev.text for ev in evs) for evs in out.values()], [evs[-1].finish_reason for evs in out.values()]


# ---------------------------------------------------------------------------------------- engine

def test_grammars_compile_once_and_reject_bad_input_naming_the_field(grammars):
    a = grammars.get("json_schema", PERSON, "response_format")
    assert grammars.get("json_schema", json.loads(json.dumps(PERSON)), "x") is a  # cached by content
    assert a.constraint() is not a.constraint()  # each row its own state
    bad = [("json_schema", {"type": "objekt"}, "invalid JSON schema"),
           ("json_schema", {"properties": {"a": {"minimum": "zero"}}}, "invalid JSON schema"),
           ("json_schema", [1], "must be an object"),
           ("regex", "(unclosed", "rejects"),
           ("json_schema", {"not": {"type": "string"}}, "rejects it: Unimplemented keys"),  # unsupported
           ("regex", r"[^\s\S]", "no output of this model's tokens can match it"),
           ("grammar", 'root ::= "a" undefined_rule', "Rule 'undefined_rule' not found"),
           ("choice", [], "non-empty list"),
           ("kind", "x", "unknown grammar kind")]
    for kind, value, words in bad:
        with pytest.raises(GrammarError, match=re.escape(words)) as e:
            grammars.get(kind, value, "the_field")
        assert e.value.field == "the_field" and str(e.value).startswith("the_field: ")


def test_draft_tokens_the_grammar_rejects_are_rejected(model, grammars):
    c = grammars.get("choice", ["yes", "no"], "choice").constraint()
    ids = model.tokenizer.encode("yes", add_special_tokens=False)
    assert c.accept_draft(ids) == len(ids)  # nothing consumed: the same draft again
    assert c.accept_draft(ids + ids) == len(ids)  # "yesyes": the second copy is rejected
    assert c.accept_draft(model.tokenizer.encode("maybe", add_special_tokens=False)) == 0


def test_constrained_rows_beside_unconstrained_rows(model, grammars):
    free = SamplingParams(max_tokens=24, temperature=0)
    alone, _ = _run(model, [("hello there", free)])
    specs = [("hello there", SamplingParams(max_tokens=240, temperature=t, seed=3,
                                            grammar=grammars.get("json_schema", s, "rf")))
             for s, t in zip(SCHEMAS[:3], (0.0, 1.0, 0.7))]
    specs.append(("hello there", free))
    texts, reasons = _run(model, specs)
    for text, reason, schema in zip(texts[:3], reasons, SCHEMAS[:3]):
        assert reason == "stop", text  # the grammar completed: the row ended there
        jsonschema.validate(json.loads(text), schema)
    assert texts[3] == alone[0]  # the unconstrained row is untouched by its neighbours' masks
    texts, reasons = _run(model, [("x", SamplingParams(max_tokens=30, temperature=1.0, seed=s,
                                                       grammar=grammars.get("regex", r"[0-9]{3}-[a-c]{2}", "regex")))
                                  for s in range(4)])
    assert reasons == ["stop"] * 4 and all(re.fullmatch(r"[0-9]{3}-[a-c]{2}", t) for t in texts), texts


def test_model_generate_with_response_format_and_grammar(model):
    """The Python API: Model.generate(response_format=) / (grammar=), each row its own state; a
    complete row ends with an end token, a row cut by max_new_tokens has none."""
    pydantic = pytest.importorskip("pydantic")
    tok = model.tokenizer
    ids = [tok.encode("hello there", add_special_tokens=False)[:3], tok.encode("the capital", add_special_tokens=False)[:3]]
    ends = set(model.eos_ids) | tok.eos_ids

    def rows(out):
        texts = []
        for row in out[:, 3:].tolist():
            assert any(t in ends for t in row), tok.decode(row)  # it ended
            texts.append(tok.decode(row[:next(i for i, t in enumerate(row) if t in ends)]))
        return texts

    gen = torch.Generator().manual_seed(0)
    out = model.generate(torch.tensor(ids), 200, temperature=1.0, generator=gen, response_format=POINT)
    for text in rows(out):
        jsonschema.validate(json.loads(text), POINT)

    class Pet(pydantic.BaseModel):
        kind: Literal["cat", "dog"]
        legs: int = pydantic.Field(ge=0, le=4)

    for text in rows(model.generate(torch.tensor(ids), 200, response_format=Pet)):
        Pet.model_validate_json(text)
    gbnf = 'root ::= "(" [1-9] " " ("+" | "*") " " [1-9] ")"'
    for text in rows(model.generate(torch.tensor(ids), 40, temperature=0.9, generator=gen, grammar=gbnf)):
        assert re.fullmatch(r"\([1-9] [+*] [1-9]\)", text), text
    cut = model.generate(torch.tensor(ids), 3, response_format=POINT)[:, 3:].tolist()
    assert all(len(r) == 3 and not ends & set(r) for r in cut)  # max_new_tokens first: cut, incomplete
    with pytest.raises(GrammarError, match="response_format: invalid JSON schema"):
        model.generate(torch.tensor(ids), 3, response_format={"type": "objekt"})
    with pytest.raises(GrammarError, match="not both"):
        model.generate(torch.tensor(ids), 3, response_format=POINT, grammar=gbnf)


# ---------------------------------------------------------------------------------------- speculative

# a prompt that holds the kind of text the schema makes (n-gram lookup drafts from it) and some
# the schema rejects
SPEC_PROMPT = 'name: {"name": "ada", "age": 36, "role": "admin", "tags": ["x"], "address": {"city": "x"}} {"x": 0.5, "y": 3}'


def test_constraint_draft_masks_follow_the_grammar_and_leave_its_state(model, grammars):
    g = grammars.get("json_schema", POINT, "rf")
    c = g.constraint()
    lead = model.tokenizer.encode('{"x": 0.5, "y"', add_special_tokens=False)
    bad = int((~c.allowed()).nonzero()[0, 0])
    masks = c.draft_masks(lead[:3] + [bad] + lead[3:])
    assert masks.shape == (4, model.engine.vocab_size)  # cut at the rejected draft: 3 drafts, 4 masks
    walk = g.constraint()
    for j in range(4):
        assert torch.equal(masks[j], walk.allowed()), j  # the mask after draft[:j]
        assert j == 3 or walk.accept(lead[j])
    assert torch.equal(c.allowed(), g.constraint().allowed())  # rolled back: the state it started in
    # an end token ends the lead (where the grammar may end); the state is again unchanged
    done = model.tokenizer.encode('{"x": 0.5, "y": 3}', add_special_tokens=False)
    end = sorted(g.ends)[0]
    masks = c.draft_masks(done + [end, lead[0]])
    assert masks.shape[0] == len(done) + 2 and masks[-2, end] and c.accept(lead[0])


def test_verify_step_cuts_a_draft_at_the_token_the_grammar_rejects(model, grammars):
    """The verify step itself, with a hand-made draft: the first two drafts are plain constrained
    greedy decoding's next tokens, the third one the grammar rejects. The step keeps the two, cuts
    the rest before verifying, picks plain decoding's next token from the masked logits, and leaves
    the grammar where it was; accepting the emitted tokens puts it where plain decoding is."""
    from zoo.compiler.engine.drafters import Draft, Drafter, Pick
    from zoo.compiler.engine.speculative import Speculator

    ids = torch.tensor(model.tokenizer.encode("hello there", add_special_tokens=False))
    plain = model.generate(ids[None], 8, response_format=PERSON, speculative="off")[0, ids.shape[0]:].tolist()
    g = grammars.get("json_schema", PERSON, "rf")
    after = g.constraint()
    for t in plain[:3]:
        assert after.accept(t)
    bad = int((~after.allowed()).nonzero()[0, 0])

    class Fixed(Drafter):
        name = "fixed"

        def propose(self, rows, histories, kd, picks):
            return Draft(torch.tensor([[plain[1], plain[2], bad, plain[3]]]), [4])

    spec = Speculator(model.engine, Fixed(), 4)
    spec.reset()
    spec.prefill_rows(0, ids[None])
    c = g.constraint()
    assert c.accept(plain[0])
    before = c.allowed()
    res, = spec.step([0], [torch.cat((ids, torch.tensor(plain[:1])))], [Pick(constraint=c)])
    assert res.tokens == plain[1:4] and res.error is None
    assert spec.stats.cut == 2 and spec.stats.accepted == 2
    assert model.engine.row_len[0] == ids.shape[0] + 3  # x and the two kept drafts
    assert torch.equal(c.allowed(), before)  # the step leaves the grammar's state to the caller
    for t in res.tokens:
        assert c.accept(t)
    walk = g.constraint()
    for t in plain[:4]:
        walk.accept(t)
    assert torch.equal(c.allowed(), walk.allowed())
    spec.reset()


def test_generate_speculative_with_a_constraint_equals_plain(model):
    """Model.generate(response_format=, speculative="ngram"): greedy gives constrained plain
    decoding's tokens (batch 2, rows at different lengths), drafts were kept and some cut by the
    grammar; sampled output validates."""
    tok = model.tokenizer
    ids = torch.tensor([tok.encode(SPEC_PROMPT, add_special_tokens=False)[-24:],
                        tok.encode("hello there " + SPEC_PROMPT, add_special_tokens=False)[:24]])
    spec = model.speculator("ngram", 3)
    before = dataclasses.replace(spec.stats)
    for schema in (PERSON, POINT):
        plain = model.generate(ids, 80, response_format=schema, speculative="off")
        got = model.generate(ids, 80, response_format=schema, speculative="ngram", draft_tokens=3)
        assert torch.equal(got, plain), schema
    assert spec.stats.accepted > before.accepted and spec.stats.cut > before.cut
    ends = set(model.eos_ids) | tok.eos_ids
    out = model.generate(ids, 120, temperature=1.0, generator=torch.Generator().manual_seed(1),
                         response_format=POINT, speculative="ngram", draft_tokens=3)
    for row in out[:, ids.shape[1]:].tolist():
        jsonschema.validate(json.loads(tok.decode(row[:next(i for i, t in enumerate(row) if t in ends)])), POINT)


def test_scheduler_speculates_constrained_rows_beside_free_rows(model, grammars):
    """zoo serve's scheduler with n-gram speculation: a constrained greedy row and a free greedy
    row in one batch get plain serving's tokens; the constrained one validates and stops there."""
    g = grammars.get("json_schema", FLAGS, "rf")
    ids = model.tokenizer.encode(SPEC_PROMPT, add_special_tokens=False)

    from zoo.serve.metrics import Metrics

    metrics = Metrics()

    def run(speculative):
        sched, events = Scheduler(model, speculative=speculative, draft_tokens=3, metrics=metrics), ([], [])
        seqs = [Sequence(ids, SamplingParams(max_tokens=100, temperature=0, grammar=g), events[0].append,
                         tokenizer=model.tokenizer),
                Sequence(ids, SamplingParams(max_tokens=30, temperature=0), events[1].append,
                         tokenizer=model.tokenizer)]
        sched.submit(seqs)
        while sched.step():
            pass
        return seqs, sched.spec

    plain, _ = run("off")
    before = dataclasses.replace(model.speculator("ngram", 3).stats)  # the speculator is the model's, shared
    got, spec = run("ngram")
    assert [s.tokens for s in got] == [s.tokens for s in plain]
    assert got[0].finish_reason == "stop" and spec.stats.accepted > before.accepted
    assert metrics.spec_cut._value.get() == spec.stats.cut - before.cut > 0  # zoo_spec_grammar_rejected_tokens
    jsonschema.validate(json.loads(model.tokenizer.decode(got[0].tokens)), FLAGS)


def test_a_grammar_dead_end_under_speculation_fails_only_its_row(model, grammars):
    """A constrained row whose grammar reaches a dead end at a verify step (draft_masks raises, as
    llguidance's matcher can on a grammar that leads nowhere) ends with an error naming it; the
    free row beside it gets the tokens it gets alone."""

    class DeadEnd:  # a real row state whose next verification finds no way on
        def __init__(self, c):
            self.c = c

        def __getattr__(self, name):
            return getattr(self.c, name)

        def draft_masks(self, draft):
            raise GrammarError("grammar", "no token can continue the output here (dead end)")

    ids = model.tokenizer.encode(SPEC_PROMPT, add_special_tokens=False)
    g = grammars.get("json_schema", POINT, "rf")

    def run(with_dead_end):
        sched, events = Scheduler(model, speculative="ngram", draft_tokens=3), []
        free = Sequence(ids, SamplingParams(max_tokens=12, temperature=0), lambda ev: None)
        seqs = [free]
        if with_dead_end:
            dead = Sequence(ids, SamplingParams(max_tokens=12, temperature=0, grammar=g), events.append)
            dead.constraint = DeadEnd(dead.constraint)
            seqs = [dead, free]
        sched.submit(seqs)
        while sched.step():
            pass
        return free.tokens, events

    alone, _ = run(False)
    beside, events = run(True)
    assert beside == alone
    assert events[-1].finish_reason == "error" and "no token can continue" in events[-1].error


# ---------------------------------------------------------------------------------------- HTTP

@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    # with n-gram speculation: every constrained request below runs through grammar-masked
    # verification (the scheduler tests above cover constrained rows without it)
    args = [f"weights={ckpt}", f"api_key={KEY}", f"model_name={NAME}", "max_seq=256", "max_batch=4",
            "compile=false", "log_level=warning", "speculative=ngram", "draft_tokens=3"]
    with running_server(args, tmp_path_factory.mktemp("log")) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, timeout=120, max_retries=0)


MSG = [{"role": "user", "content": "Describe a person as JSON."}]


def test_json_schema_batch_validates(client):
    def ask(i_schema):
        i, schema = i_schema
        r = client.chat.completions.create(
            model=NAME, messages=MSG, max_tokens=215, temperature=0.8, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                    "strict": True}})
        return r.choices[0], schema

    with ThreadPoolExecutor(4) as pool:  # concurrent: the schemas share decode steps
        for choice, schema in pool.map(ask, enumerate(SCHEMAS)):
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), schema)
    r = client.chat.completions.create(model=NAME, messages=MSG, max_tokens=215, temperature=0,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_extra_body_regex_grammar_choice_and_streaming(client):
    r = client.chat.completions.create(model=NAME, messages=MSG, max_tokens=20, temperature=1.0, seed=1, n=2,
                                       extra_body={"choice": ["cat", "dog", "bird"]})
    assert all(c.message.content in ("cat", "dog", "bird") and c.finish_reason == "stop" for c in r.choices)
    r = client.completions.create(model=NAME, prompt="phone:", max_tokens=20, temperature=0,
                                  extra_body={"regex": r"\+1 [0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"\+1 [0-9]{3}-[0-9]{4}", r.choices[0].text), r.choices[0].text
    gbnf = 'root ::= "(" num " " op " " num ")"\nnum ::= [1-9] [0-9]?\nop ::= "+" | "*"'
    r = client.chat.completions.create(model=NAME, messages=MSG, max_tokens=20, temperature=0.9, seed=2,
                                       extra_body={"grammar": gbnf})
    assert re.fullmatch(r"\([1-9][0-9]? [+*] [1-9][0-9]?\)", r.choices[0].message.content)
    chunks = client.chat.completions.create(model=NAME, messages=MSG, max_tokens=215, temperature=0, stream=True,
                                            response_format={"type": "json_schema",
                                                             "json_schema": {"name": "p", "schema": POINT}})
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    jsonschema.validate(json.loads(text), POINT)


def test_parse_with_a_pydantic_model(client):
    pydantic = pytest.importorskip("pydantic")

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=10)
        population: int = pydantic.Field(ge=0, le=10**6)

    class Answer(pydantic.BaseModel):
        kind: Literal["yes", "no"]
        cities: list[City] = pydantic.Field(max_length=2)

    r = client.chat.completions.parse(model=NAME, messages=MSG, max_tokens=215, temperature=0, response_format=Answer)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Answer) and parsed.kind in ("yes", "no")


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"regex": "([a-z]"}, "regex"),
    ({"grammar": "root ::= missing"}, "grammar"),
    ({"choice": "yes"}, "choice"),
    ({"choice": ["a"], "regex": "b"}, "choice"),  # the second of two constraints
])
def test_bad_constraints_are_400_naming_the_field(server, extra, param):
    import httpx

    body = {"model": NAME, "messages": MSG, "max_tokens": 4, **extra}
    r = httpx.post(server + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    ok = httpx.post(server + "/v1/chat/completions", json={"model": NAME, "messages": MSG, "max_tokens": 2},
                    headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert ok.status_code == 200  # the server goes on


# ---------------------------------------------------------------------------------------- SmolLM2

def test_smollm2_schema_batch(smollm2_gguf):
    """Real weights (the shipped GGUF), greedy, three schemas in one batch (nested objects, enums,
    arrays, bounded numbers): every output parses and validates; served again with n-gram
    speculation (grammar-masked verification), the same tokens."""
    m = zoo.from_pretrained(str(smollm2_gguf), compile=False, max_batch=3, max_seq=160)
    g = Grammars(m.tokenizer, m.engine.vocab_size, Scheduler(m).eos)
    prompts = ["Give a point as JSON.", "Give flags with a list of points as JSON.", "List some colours as a JSON array."]
    schemas = SCHEMAS[1:]
    specs = []
    for p, s in zip(prompts, schemas):
        text = m.tokenizer.apply_chat_template([{"role": "user", "content": p}])
        specs.append((text, SamplingParams(max_tokens=100, temperature=0, grammar=g.get("json_schema", s, "rf"))))
    def serve(speculative):
        sched, out = Scheduler(m, speculative=speculative, draft_tokens=3), [[] for _ in specs]
        sched.submit([Sequence(m.tokenizer.encode(t, add_special_tokens=False), p, out[i].append,
                               tokenizer=m.tokenizer) for i, (t, p) in enumerate(specs)])
        while sched.step():
            pass
        return out, sched.spec

    out, _ = serve("off")
    for evs, schema in zip(out, schemas):
        text = "".join(ev.text for ev in evs)
        assert evs[-1].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
    spec_out, spec = serve("ngram")
    assert [[ev.token for ev in evs] for evs in spec_out] == [[ev.token for ev in evs] for evs in out]
    assert spec.stats.accepted > 0
