"""Reasoning (zoo.reasoning, zoo/serve/chat.py): the text between a thinking model's markers
comes back apart as reasoning_content, whole and streamed (delta.reasoning_content), and a
constraint (response_format, a forced tool call) starts after the reasoning, which stays free
text. `zoo serve` with a twin whose template opens a <think> block, through the openai client."""
from __future__ import annotations

import json

import pytest

from tests.serve_fixtures import grammars_for, running_server, write_tiny_llama
from tests.test_tools import HERMES, MARKERS, TOOLS, _stream, _walk, reassemble
from zoo.reasoning import REASONING, detect
from zoo.serve.chat import ChatPlan
from zoo.tools import by_name, check_tools

jsonschema = pytest.importorskip("jsonschema")
THINK = REASONING[0]

# the Hermes twin's template, thinking as DeepSeek-R1 / Qwen3 do: the generation prompt opens a
# <think> block (an empty closed one with enable_thinking=false); earlier turns' reasoning is cut
THINKING = HERMES.replace("{{ m.content or '' }}", "{{ (m.content or '').split('</think>')[-1].lstrip() }}").replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
    "{% if enable_thinking is defined and not enable_thinking %}\n</think>\n\n{% endif %}{% endif %}")


@pytest.mark.parametrize("step", [1, 4])
def test_reasoning_apart_whole_and_streamed(step):
    cases = [  # (text, the prompt opened the block, reasoning, content, finish_reason)
        ("<think>\nWeigh it.\n</think>\n\nParis is sunny.", False, "Weigh it.", "Paris is sunny.", "stop"),
        ("Weigh it.\n</think>\n\nParis is sunny.", True, "Weigh it.", "Paris is sunny.", "stop"),
        ("Paris is sunny.", False, None, "Paris is sunny.", "stop"),
        ("Still weighing it", True, "Still weighing it", "", "length"),  # max_tokens inside the block
    ]
    for text, opened, reasoning, content, reason in cases:
        deltas, r_stream, msg, r = _stream(None, text, reason=reason, step=step, thinks=THINK, opened=opened)
        assert r == r_stream == reason
        assert (msg["reasoning_content"], msg["content"]) == (reasoning, content), text
        got = reassemble(deltas)
        assert (got["reasoning_content"], got["content"]) == (reasoning or "", content), text
    # with tools: the call after the reasoning
    text = '<think>\nThe weather tool.\n</think>\n\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    deltas, r_stream, msg, r = _stream(by_name("hermes"), text, step=step, thinks=THINK)
    assert r == r_stream == "tool_calls" and msg["reasoning_content"] == "The weather tool."
    assert msg["content"] is None and msg["tool_calls"][0]["function"]["arguments"] == '{"tz": "UTC"}'
    assert reassemble(deltas)["tool_calls"] == [["get_time", '{"tz": "UTC"}']]


def test_the_markers_are_read_off_the_template():
    assert detect(THINKING) == THINK and detect(HERMES) is None
    assert THINK.opened("<|im_start|>assistant\n<think>\n") is True
    assert THINK.opened("<|im_start|>assistant\n<think>\n\n</think>\n\n") is None  # thinking off
    assert THINK.opened("<|im_start|>assistant\n") is False


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("reasoning") / "ckpt", vocab_size=420, chat_template=THINKING,
                            added=tuple(MARKERS))


@pytest.fixture(scope="module")
def grammars(ckpt):
    return grammars_for(ckpt)


@pytest.fixture(scope="module")
def text_markers(tmp_path_factory):
    """A tokenizer without <think> tokens: the markers are spelled in text."""
    from zoo.constrain import Grammars
    from zoo.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(write_tiny_llama(tmp_path_factory.mktemp("plain") / "ckpt", chat_template=THINKING))
    return tok, Grammars(tok, tok.vocab_size, tok.eos_ids)


@pytest.mark.parametrize("which", ["grammars", "text_markers"])
def test_the_grammar_starts_after_the_reasoning(which, request):
    tok, g = request.getfixturevalue(which)
    ids = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert (len(ids("</think>")) == 1) == (which == "grammars")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for opened, lead in [(True, ""), (False, "<think>")]:
        plan = ChatPlan(reasoning=THINK)
        _, prefix = plan.constraint(g.literal, "<think>\n" if opened else "")
        c = g.get("json_schema", schema, "response_format", prefix=prefix).constraint()
        for t in ids(lead + "Not JSON at all: {x </thin k>"):  # free text in the block
            assert bool(c.allowed()[t]), tok.decode([t])
            assert c.accept(t)
        allowed = c.allowed()
        assert bool(allowed[ids("Not")[0]]) and bool(allowed[ids("{")[0]])
        for t in ids("</think>"):
            assert c.accept(t), c.error
        allowed = c.allowed()
        assert not bool(allowed[ids("Not")[0]]) and bool(allowed[ids("{")[0]])  # now the JSON
        for t in ids('\n\n{"a": 12}'):
            assert c.accept(t), c.error
        assert c.done
    # thinking may be skipped when the prompt did not open the block: the JSON right away
    _, prefix = ChatPlan(reasoning=THINK).constraint(g.literal, "")
    c = g.get("json_schema", schema, "response_format", prefix=prefix).constraint()
    assert bool(c.allowed()[ids("{")[0]]) and not bool(c.allowed()[ids("Not")[0]])


def test_a_forced_call_after_free_reasoning_parses(grammars):
    tok, g = grammars
    plan = ChatPlan(fmt=by_name("hermes"), tools=check_tools(TOOLS), choice={"name": "get_time"}, reasoning=THINK)
    (kind, value, field, prefix), _ = plan.constraint(g.literal, "<think>\n")
    grammar = g.get(kind, value, field, prefix=prefix)
    for seed in range(2):
        text = _walk(tok, grammar, seed, steps=6000)
        out = plan.output("<think>\n")
        out.feed(text)
        msg, reason = out.message("stop")
        assert reason == "tool_calls" and msg["tool_calls"][0]["function"]["name"] == "get_time", text
        assert json.loads(msg["tool_calls"][0]["function"]["arguments"])["tz"] in ("UTC", "CET")
        assert msg["reasoning_content"] == text.split("</think>")[0].strip() or None


# ---------------------------------------------------------------------------------------- HTTP

NAME, KEY = "tiny-think", "sk-think"
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def client(ckpt, tmp_path_factory):
    openai = pytest.importorskip("openai")
    pytest.importorskip("llguidance")
    args = [f"weights={ckpt}", f"api_key={KEY}", f"model_name={NAME}", "max_seq=1024", "max_batch=2",
            "compile=false", "log_level=warning"]
    with running_server(args, tmp_path_factory.mktemp("log")) as (base, _):
        yield openai.OpenAI(base_url=base + "/v1", api_key=KEY, timeout=120, max_retries=0)


def test_reasoning_content_whole_and_streamed(client):
    kw = dict(model=NAME, messages=ASK, max_tokens=40, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0]
    reasoning = whole.message.model_extra["reasoning_content"]
    assert isinstance(reasoning, str) and reasoning  # the prompt opened the block: the reply starts in it
    chunks = [ch for ch in client.chat.completions.create(**kw, stream=True) if ch.choices]
    deltas = [ch.choices[0].delta.model_dump(exclude_none=True) for ch in chunks]
    got = reassemble(deltas)
    assert got["reasoning_content"] == reasoning and got["content"] == (whole.message.content or "")
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason


def test_schema_after_the_reasoning_and_with_thinking_off(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    r = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=40, temperature=0, response_format=rf,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    ch = r.choices[0]
    assert ch.finish_reason == "stop" and ch.message.model_extra["reasoning_content"] is None
    jsonschema.validate(json.loads(ch.message.content), schema)
    # thinking on: the reasoning is free text (this random model never closes the block here)
    r = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=40, temperature=0, response_format=rf)
    ch = r.choices[0]
    assert ch.finish_reason == "length" and not ch.message.content
    assert not ch.message.model_extra["reasoning_content"].lstrip().startswith("{")
