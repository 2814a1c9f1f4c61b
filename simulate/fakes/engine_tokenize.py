"""vLLM's ``/tokenize`` and ``/detokenize`` on the fake engine's tokenizer.

Shapes from vllm/entrypoints/serve/tokenize/protocol.py and serving.py (vLLM 0.32): ``/tokenize`` takes a
``prompt`` (``TokenizeCompletionRequest``) or chat ``messages`` with ``tools`` (``TokenizeChatRequest``, rendered by
the chat template as a chat request is) and answers ``{count, max_model_len, tokens, token_strs}``; ``/detokenize``
takes ``tokens`` (integers from 0) and answers ``{prompt}``, decoded with the tokenizer's own ``decode``, so special
tokens keep their text. The fake's prompt pieces outside its vocabulary are hashed ids without text
(simulate/fakes/tokens.py): only generated ids, markers and bytes decode to text.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from simulate.fakes.engine_config import EngineConfig
from simulate.fakes.openai_format import InvalidRequest, error_body, read_job
from simulate.fakes.tokens import text_of
from simulate.fakes.tokens import tokenize as tokens_of


async def _body(request: web.Request) -> dict[str, Any] | web.Response:
    try:
        body = await request.json()
    except ValueError:
        return web.json_response(error_body("invalid request body"), status=400)
    if not isinstance(body, dict):
        return web.json_response(error_body("the body must be a JSON object"), status=400)
    return body


async def tokenize(request: web.Request, *, config: EngineConfig) -> web.Response:
    body = await _body(request)
    if isinstance(body, web.Response):
        return body
    if "messages" in body:
        parsers = config.chat_parsers
        try:
            ids = read_job(body, chat=True, max_model_len=config.max_model_len, parsers=parsers).prompt_ids
        except InvalidRequest as error:
            return web.json_response(error_body(str(error), kind=error.kind, param=error.param), status=400)
    elif isinstance(body.get("prompt"), str):
        ids = tokens_of(body["prompt"])
    else:
        return web.json_response(error_body("body.prompt: Field required", kind="Bad Request"), status=400)
    answer = {"count": len(ids), "max_model_len": config.max_model_len, "tokens": ids, "token_strs": None}
    return web.json_response(answer)


async def detokenize(request: web.Request, *, config: EngineConfig) -> web.Response:
    body = await _body(request)
    if isinstance(body, web.Response):
        return body
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        message = "body.tokens: Input should be a valid list of integers greater than or equal to 0"
        return web.json_response(error_body(message, kind="Bad Request", param="body.tokens"), status=400)
    return web.json_response({"prompt": text_of(ids)})
