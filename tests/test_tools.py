"""Tool calls (zoo.tools, zoo/serve/chat.py): each family's format parsed from the text its
template teaches (whole and streamed: the deltas add up to the whole), the format read off the
chat template, the grammar of a forced call (every output it admits parses into a call whose
arguments validate), and `zoo serve` with a Hermes-template twin through the official openai
client: tool_choice named / required always yields a valid call, a call -> tool result -> answer
round trip, streamed tool-call deltas equal to the non-streamed reply, bad tools as 400s naming
the field, the same calls through /v1/messages and /v1/responses. Eager models only."""
from __future__ import annotations

import json
import random

import pytest

from tests.serve_fixtures import grammars_for, running_server, write_tiny_llama
from zoo.serve.chat import ChatOutput, ChatPlan
from zoo.tools import FORMATS, ToolError, by_name, check_choice, check_tools, detect

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}

# a reply in each format, as the family's chat template teaches it (two calls, the Hermes and
# DeepSeek ones after some text)
W, T = '{"city": "Paris", "days": 2}', '{"tz": "CET"}'
REPLIES = {
    "hermes": f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>\n'
              f'<tool_call>\n{{"name": "get_time", "arguments": {T}}}\n</tool_call>',
    "llama3_json": f'{{"name": "get_weather", "parameters": {W}}}; {{"name": "get_time", "parameters": {T}}}',
    "mistral": f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {W}}}, {{"name": "get_time", "arguments": {T}}}]',
    "mistral_args": f'[TOOL_CALLS]get_weather[ARGS]{W}[TOOL_CALLS]get_time[ARGS]{T}',
    "deepseek_v3": f'Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{W}\n'
                   f'```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{T}\n```'
                   f'<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "deepseek_v31": f'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{W}<｜tool▁call▁end｜>'
                    f'<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{T}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "glm": '<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n'
           '<arg_value>2</arg_value>\n</tool_call>\n<tool_call>get_time\n<arg_key>tz</arg_key>\n<arg_value>CET</arg_value>\n'
           '</tool_call>',
    "harmony": f'<|channel|>analysis<|message|>Weather first, then time.<|end|><|start|>assistant<|channel|>'
               f'commentary to=functions.get_weather <|constrain|>json<|message|>{W}<|call|><|start|>assistant'
               f'<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{T}',
}
CONTENT = {"hermes": "Let me check.", "deepseek_v3": "Sure."}
# the lines of each family's template that name its format (detection reads these)
TEMPLATES = {
    "hermes": 'For each function call, return a json object within <tool_call></tool_call> XML tags',
    "llama3_json": 'Respond in the format {"name": function name, "parameters": dictionary of argument name and '
                   'its value}. {%- if message.content %}<|python_tag|>{% endif %}',
    "mistral": "{{- '[AVAILABLE_TOOLS] ' }}{{- '[TOOL_CALLS] ' + tool_calls | tojson }}",
    "mistral_args": "{{- '[TOOL_CALLS]' + tool.name + '[ARGS]' + arguments }}",
    "deepseek_v3": "'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']"
                   "['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments']|tojson",
    "deepseek_v31": "'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>'",
    "glm": "{{ '<tool_call>' + tc.name }}{% for k, v in args.items() %}\n<arg_key>{{ k }}</arg_key>\n<arg_value>"
           "{{ v | tojson if v is not string else v }}</arg_value>{% endfor %}\n</tool_call>",
    "harmony": "{{- '<|start|>assistant to=' + 'functions.' + name + '<|channel|>commentary json<|message|>' }}",
}


def _stream(fmt, text: str, reason="stop", step: int = 1, thinks=None, opened=False):
    """The reply fed `step` characters at a time -> (deltas, finish_reason), and the whole
    reply's message, finish_reason."""
    whole = ChatOutput(fmt, thinks, opened, thinks is not None)
    whole.feed(text)
    msg, r = whole.message(reason)
    out = ChatOutput(fmt, thinks, opened, thinks is not None)
    deltas = []
    for i in range(0, len(text), step):
        deltas += out.feed(text[i:i + step])
    more, r2 = out.finish(reason)
    return deltas + more, r2, msg, r


def reassemble(deltas: list[dict]) -> dict:
    """Streamed deltas -> {content, reasoning_content, tool_calls: [(name, arguments)]}; a call's
    first delta has its id, type and name, the later ones only argument fragments."""
    out = {"content": "", "reasoning_content": "", "tool_calls": []}
    for d in deltas:
        out["content"] += d.get("content") or ""
        out["reasoning_content"] += d.get("reasoning_content") or ""
        for tc in d.get("tool_calls") or []:
            if tc["index"] == len(out["tool_calls"]):
                assert tc["id"] and tc["type"] == "function" and tc["function"]["name"], tc
                out["tool_calls"].append([tc["function"]["name"], tc["function"]["arguments"]])
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}, tc
                out["tool_calls"][tc["index"]][1] += tc["function"]["arguments"]
    return out


# ---------------------------------------------------------------------------------------- parsers

@pytest.mark.parametrize("name", list(REPLIES))
@pytest.mark.parametrize("step", [1, 5])
def test_each_format_parses_whole_and_streamed(name, step):
    deltas, r_stream, msg, r = _stream(by_name(name), REPLIES[name], step=step)
    assert r == r_stream == "tool_calls"
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]]
    assert calls == [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"tz": "CET"})], msg
    assert msg["content"] == CONTENT.get(name), msg
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in msg["tool_calls"]) if name.startswith("mistral") \
        else all(c["id"].startswith("call_") for c in msg["tool_calls"])
    got = reassemble(deltas)
    assert got["content"] == (msg["content"] or "")
    assert [tuple(c) for c in got["tool_calls"]] == [(c["function"]["name"], c["function"]["arguments"])
                                                      for c in msg["tool_calls"]]
    if name == "harmony":  # the analysis channel is the reasoning
        assert msg["reasoning_content"] == got["reasoning_content"] == "Weather first, then time."


@pytest.mark.parametrize("name", list(REPLIES))
def test_text_without_calls_and_cut_calls(name):
    fmt = by_name(name)
    text = "<|channel|>final<|message|>It is sunny." if name == "harmony" else "It is sunny."
    deltas, r_stream, msg, r = _stream(fmt, text)
    assert r == r_stream == "stop" and msg["content"] == "It is sunny." and "tool_calls" not in msg
    assert reassemble(deltas)["content"] == "It is sunny."
    # max_tokens cut the first call: what is written so far, finish_reason length, stream == whole
    cut = REPLIES[name][:REPLIES[name].index("Paris") + 3]
    deltas, r_stream, msg, r = _stream(fmt, cut, reason="length")
    assert r == r_stream == "length"
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"], msg
    args = msg["tool_calls"][0]["function"]["arguments"]
    assert args == "{}" if name == "glm" else args.endswith('"Par'), args  # GLM: the pairs complete so far
    assert reassemble(deltas)["tool_calls"] == [[c["function"]["name"], c["function"]["arguments"]]
                                               for c in msg["tool_calls"]]


def test_an_unreadable_call_stays_content():
    text = "Sure <tool_call>\nnot json at all\n</tool_call>"
    deltas, r_stream, msg, r = _stream(by_name("hermes"), text)
    assert r == r_stream == "stop" and "tool_calls" not in msg and msg["content"] == text
    assert reassemble(deltas)["content"] == text


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_the_format_is_read_off_the_chat_template(name):
    assert detect(TEMPLATES[name]).name == name
    assert detect("{% for m in messages %}{{ m.content }}{% endfor %}") is None and detect(None) is None


def test_bad_tools_and_tool_choice_name_the_field():
    ok = check_tools(TOOLS)
    assert [t["name"] for t in ok] == ["get_weather", "get_time"] and ok[1]["parameters"] == TIME
    bad = [([], "tools"), ("x", "tools"), ([{"type": "retrieval"}], "tools[0]"),
           ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
           ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
            "tools[0].function.parameters"),
           ([TOOLS[0], TOOLS[0]], "tools[1].function.name")]
    for tools, field in bad:
        with pytest.raises(ToolError) as e:
            check_tools(tools)
        assert e.value.field == field, (tools, e.value)
    assert check_choice(None, ok) == "auto" and check_choice(None, []) == "none"
    assert check_choice({"type": "function", "function": {"name": "get_time"}}, ok) == {"name": "get_time"}
    for choice, tools, field in [("sometimes", ok, "tool_choice"), ("required", [], "tool_choice"),
                                 ({"type": "function", "function": {"name": "nope"}}, ok, "tool_choice.function.name"),
                                 ({"type": "function", "function": {"name": "get_time"}}, [], "tool_choice"),
                                 ({"function": "get_time"}, ok, "tool_choice")]:
        with pytest.raises(ToolError) as e:
            check_choice(choice, tools)
        assert e.value.field == field, (choice, e.value)


# ---------------------------------------------------------------------------------------- grammars

# every format's markers as tokens of the tiny tokenizer, so each grammar names them by id
MARKERS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>",
           "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
           "<｜tool▁sep｜>", "<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|call|>", "<|constrain|>",
           "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]
HERMES = (  # a Hermes-format template (the layout of Qwen2.5's), written for these tests
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions. Function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\nFor each function call, return a json "
    "object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for tc in m.tool_calls or [] %}{% if m.content or not loop.first %}\n{% endif %}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{% elif m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tools") / "ckpt", vocab_size=420, chat_template=HERMES,
                            added=tuple(MARKERS))


@pytest.fixture(scope="module")
def grammars(ckpt):
    return grammars_for(ckpt)


def _walk(tok, grammar, seed: int, steps: int = 3000) -> str:
    """A random path through the grammar: uniformly among the tokens it allows, until it is done
    (or may end and an end token is drawn)."""
    import torch

    rng, c, ids = random.Random(seed), grammar.constraint(), []
    for _ in range(steps):
        allowed = torch.nonzero(c.allowed()).flatten().tolist()
        assert allowed, c.error
        t = rng.choice(allowed)
        if t in tok.eos_ids:
            break
        assert c.accept(t), c.error
        ids.append(t)
        if c.done:
            break
    else:
        pytest.fail(f"no end after {steps} tokens: {tok.decode(ids, skip_special_tokens=False)!r}")
    return tok.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("name", [f.name for f in FORMATS])
def test_every_output_of_a_forced_call_grammar_parses_and_validates(grammars, name):
    tok, g = grammars
    fmt, tools = by_name(name), check_tools(TOOLS)
    for choice, parallel in [("required", True), ({"name": "get_time"}, False)]:
        plan = ChatPlan(fmt=fmt, tools=tools, choice=choice, parallel=parallel)
        (kind, value, field, prefix), _ = plan.constraint(g.literal, "")
        grammar = g.get(kind, value, field, prefix=prefix)
        for seed in range(3):
            text = _walk(tok, grammar, seed)
            msg, reason = _message(plan, text)
            assert reason == "tool_calls" and msg["tool_calls"], (text, msg)
            assert parallel or len(msg["tool_calls"]) == 1
            for call in msg["tool_calls"]:
                fn = call["function"]
                assert choice == "required" or fn["name"] == "get_time", text
                jsonschema.validate(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])


def _message(plan, text):
    out = plan.output("")
    out.feed(text)
    return out.message("stop")


# ---------------------------------------------------------------------------------------- HTTP

NAME, KEY = "tiny-tools", "sk-tools"
ASK = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Weather in Paris?"}]


def test_tools_render_through_the_template(grammars):
    tok, _ = grammars
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": W}}
    plan = ChatPlan.of(tok, {"tools": TOOLS})
    msgs = plan.messages(ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}])
    text = tok.apply_chat_template([{**m, "content": m.get("content") or ""} for m in msgs], tools=TOOLS)
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text  # the tools, as the template writes them
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>' in text  # the earlier call
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    assert plan.fmt.name == "hermes"


@pytest.fixture(scope="module")
def client(ckpt, tmp_path_factory):
    openai = pytest.importorskip("openai")
    pytest.importorskip("llguidance")
    args = [f"weights={ckpt}", f"api_key={KEY}", f"model_name={NAME}", "max_seq=1024", "max_batch=4",
            "compile=false", "log_level=warning"]
    with running_server(args, tmp_path_factory.mktemp("log")) as (base, _):
        yield openai.OpenAI(base_url=base + "/v1", api_key=KEY, timeout=120, max_retries=0), base


def _valid(call, name=None):
    assert call.type == "function" and call.id.startswith("call_")
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_and_required_choices_always_call(client):
    c, _ = client
    r = c.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, max_tokens=120, temperature=1.0, seed=5, n=3,
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
        _valid(ch.message.tool_calls[0], "get_weather")
    r = c.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0.8, seed=2, n=3,
                                  tool_choice="required", parallel_tool_calls=False)
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
        _valid(ch.message.tool_calls[0])


def test_round_trip_call_result_answer(client):
    c, _ = client
    r = c.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
                                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    msg = r.choices[0].message
    _valid(msg.tool_calls[0], "get_time")
    history = ASK + [msg.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "12:00"}]
    r = c.chat.completions.create(model=NAME, messages=history, tools=TOOLS, tool_choice="none", max_tokens=16,
                                  temperature=0)
    answer = r.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.tool_calls is None
    assert isinstance(answer.message.content, str)
    # auto: whatever this random model writes comes back as content or calls that parse
    r = c.chat.completions.create(model=NAME, messages=history, tools=TOOLS, max_tokens=16, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_streamed_calls_equal_the_whole_reply(client):
    c, _ = client
    kw = dict(model=NAME, messages=ASK, tools=TOOLS, max_tokens=150, temperature=0, tool_choice="required")
    whole = c.chat.completions.create(**kw).choices[0]
    chunks = list(c.chat.completions.create(**kw, stream=True))
    deltas = [ch.choices[0].delta.model_dump(exclude_none=True) for ch in chunks if ch.choices]
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    got = reassemble(deltas)
    assert finish == [whole.finish_reason] == ["tool_calls"]
    assert got["tool_calls"] == [[t.function.name, t.function.arguments] for t in whole.message.tool_calls]
    assert got["content"] == (whole.message.content or "")
    assert len([d for d in deltas if d.get("tool_calls")]) > 2  # the arguments came in fragments


def test_a_constrained_output_cut_by_max_tokens_ends_with_length(client):
    c, _ = client
    r = c.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, max_tokens=4, temperature=0,
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    ch = r.choices[0]
    assert ch.finish_reason == "length" and r.usage.completion_tokens == 4
    r = c.chat.completions.create(model=NAME, messages=ASK, max_tokens=3, temperature=0,  # > 3 tokens to complete
                                  response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


@pytest.mark.parametrize("extra, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools[0].function.parameters"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                               "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages"),
])
def test_bad_tool_requests_are_400_naming_the_field(client, extra, param):
    import httpx

    _, base = client
    body = {"model": NAME, "messages": ASK, "max_tokens": 4, **extra}
    r = httpx.post(base + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    ok = httpx.post(base + "/v1/chat/completions", json={"model": NAME, "messages": ASK, "max_tokens": 2},
                    headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None


def test_messages_and_responses_calls_in_the_template_format(client):
    """/v1/messages and /v1/responses (tests/test_apis.py covers them on a model without a
    format) reach the same Hermes calls as chat: forced calls validate, streamed equals whole,
    auto is served."""
    anthropic = pytest.importorskip("anthropic")
    c, base = client
    claude = anthropic.Anthropic(base_url=base, api_key=KEY, timeout=120, max_retries=0)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    kw = dict(model=NAME, max_tokens=120, tools=tools, messages=[{"role": "user", "content": "Weather in Paris?"}],
              tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body={"temperature": 0})
    r = claude.messages.create(**kw)
    (use,) = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use"
    jsonschema.validate(use.input, SCHEMAS[use.name])
    with claude.messages.stream(**kw) as st:
        final = st.get_final_message()
    assert [b.model_dump() for b in final.content if b.type == "tool_use"][0]["input"] == use.input
    auto = claude.messages.create(**{**kw, "tool_choice": {"type": "auto"}, "max_tokens": 16})
    assert auto.stop_reason in ("end_turn", "max_tokens", "tool_use")
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    req = dict(model=NAME, input="Weather in Paris?", tools=flat, max_output_tokens=120, temperature=0,
               tool_choice={"type": "function", "name": "get_weather"})
    (whole,) = c.responses.create(**req).output
    events = list(c.responses.create(**req, stream=True))
    assert whole.type == "function_call" and whole.name == "get_weather"
    jsonschema.validate(json.loads(whole.arguments), WEATHER)
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == whole.arguments
    assert events[-1].type == "response.completed"


# ---------------------------------------------------------------------------------------- SmolLM2

def test_smollm2_forced_calls_validate(smollm2_gguf):
    """Real weights (the shipped GGUF; its template knows no tools): a named and a required call
    in the Hermes format, named as `zoo serve tool_format=hermes` would, and the same two as the
    forced JSON of a model without a format (zoo/tools/forced.py, what zoo serve answers without
    tool_format), greedy, in one batch: each parses and its arguments validate."""
    import zoo
    from zoo.constrain import Grammars
    from zoo.serve.scheduler import SamplingParams, Scheduler, Sequence

    m = zoo.from_pretrained(str(smollm2_gguf), compile=False, max_batch=4, max_seq=256)
    g = Grammars(m.tokenizer, m.engine.vocab_size, Scheduler(m).eos)
    named = {"type": "function", "function": {"name": "get_weather"}}
    plans = [ChatPlan(fmt=by_name("hermes"), tools=check_tools(TOOLS), choice=choice, parallel=False)
             for choice in ({"name": "get_weather"}, "required")]
    plans += [ChatPlan.of(m.tokenizer, {"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False})
              for choice in (named, "required")]
    assert [p.fmt.name for p in plans] == ["hermes", "hermes", "json", "json"]
    prompt = m.tokenizer.apply_chat_template([{"role": "user", "content": "What is the weather in Paris "
                                                                          "for the next 3 days?"}], tools=TOOLS)
    seqs, out = [], [[] for _ in plans]
    for i, plan in enumerate(plans):
        (kind, value, field, prefix), _ = plan.constraint(g.literal, prompt)
        params = SamplingParams(max_tokens=80, temperature=0, keep_special=True,
                                grammar=g.get(kind, value, field, prefix=prefix))
        seqs.append(Sequence(m.tokenizer.encode(prompt, add_special_tokens=False), params, out[i].append,
                             tokenizer=m.tokenizer))
    sched = Scheduler(m)
    sched.submit(seqs)
    while sched.step():
        pass
    for plan, evs in zip(plans, out):
        text = "".join(ev.text for ev in evs)
        msg, reason = _message(plan, text)
        assert evs[-1].finish_reason == "stop" and reason == "tool_calls", text
        (call,) = msg["tool_calls"]
        assert plan.choice == "required" or call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
