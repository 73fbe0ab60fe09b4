"""/tokenize and /detokenize, in vLLM's shapes (what clients that count tokens or build token-id
prompts for /v1/completions call):

    POST /tokenize   {"prompt": str, "add_special_tokens": bool = true}
                  or {"messages": [...], "add_special_tokens": bool = false}  (the chat template's
                     prompt, with the generation prompt, as /v1/chat/completions builds it)
                  -> {"tokens": [int], "count": int, "max_model_len": int}
    POST /detokenize {"tokens": [int]} -> {"prompt": str}
    GET /tokenizer_info -> {"eos_token", "bos_token", "pad_token", "chat_template", "model_max_length",
                            "vocab_size"}

With the three, lm-evaluation-harness' remote tokenizer (`tokenizer_backend=remote`, or `auto`,
which probes /tokenizer_info) tokenizes through the server: no local tokenizer needed, so a
served GGUF file is scored with the tokenizer read from it.

"model" is optional here (as in vLLM); when sent it must be the served name. Errors are the
API's (api.APIError): 400 naming the field.
"""
from __future__ import annotations

from fastapi import FastAPI, Request


def add_routes(app: FastAPI, server, body_of, field, api_error) -> None:
    """Register the two routes; body_of(request, need_model) -> the checked JSON body, field /
    api_error: api._field / api.APIError."""

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await body_of(request, need_model=False)
        has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
        if has_prompt == has_messages:
            raise api_error(400, "send exactly one of 'prompt' (a string) or 'messages' (a chat)", param="prompt",
                            code="invalid_value" if has_prompt else "missing_field")
        special = field(body, "add_special_tokens", bool, has_prompt)
        if has_prompt:
            text = field(body, "prompt", str)
            tokens = server.need_tokenizer("/tokenize").encode(text, add_special_tokens=special)
        else:
            tokens, text = server.chat_prompt(body, server.chat_plan(body))
            if special:  # the template writes its own BOS: this asks for the tokenizer's on top
                tokens = server.tokenizer.encode(text, add_special_tokens=True)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": server.max_seq}

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        server.check_auth(request)
        tok = server.need_tokenizer("/tokenizer_info")
        return {"eos_token": tok.eos_token, "bos_token": tok.bos_token, "pad_token": None,
                "chat_template": tok.chat_template, "model_max_length": server.max_seq, "vocab_size": tok.vocab_size}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await body_of(request, need_model=False)
        tokens = field(body, "tokens", list)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise api_error(400, "'tokens' must be a list of integers", param="tokens", code="invalid_type")
        bad = [t for t in tokens if not 0 <= t < server.vocab]
        if bad:
            raise api_error(400, f"'tokens': token id {bad[0]} is outside the vocabulary [0, {server.vocab})",
                            param="tokens", code="invalid_value")
        tok = server.need_tokenizer("/detokenize")
        return {"prompt": tok.decode(tokens, skip_special_tokens=False)}
