"""The ASGI application: routes, API-key check, body size limit, and errors as OpenAI JSON.

Every failure a client can cause is an APIError with a 4xx status and the nested error object;
anything else is logged with its traceback and answered 500 with the same shape, never a hang or
an HTML page. /health, /metrics, /version and /ping stay open when --api-key is set (probes and
scrapers carry no key); everything under /v1 and /tokenize, /detokenize needs it.
"""
from __future__ import annotations

import hmac
import logging
from contextlib import asynccontextmanager

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from serve import protocol
from serve.chat_completions import create_chat_completion
from serve.completions import create_completion
from serve.context import ServerContext
from serve.errors import APIError, BadRequest, EngineDead, NotFound, PayloadTooLarge, Unauthorized
from serve.metrics import CONTENT_TYPE

log = logging.getLogger("dsv4gen.serve")
OPEN_PATHS = ("/health", "/metrics", "/version", "/ping")
VERSION = "0.1.0"


def _json(payload, status: int = 200, headers: dict | None = None) -> Response:
    return Response(msgspec.json.encode(payload), status, headers, media_type="application/json")


def _error(err: APIError) -> Response:
    return Response(err.body(), err.status, err.headers, media_type="application/json")


async def _body(ctx: ServerContext, request: Request) -> bytes:
    """The request body, refused (413) as soon as it passes the limit, declared or not."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > ctx.max_body_bytes:
        raise PayloadTooLarge(f"the request body ({declared} bytes) is over the limit of {ctx.max_body_bytes} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > ctx.max_body_bytes:
            raise PayloadTooLarge(f"the request body is over the limit of {ctx.max_body_bytes} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body.strip():
        raise BadRequest("the request body is empty; send a JSON object")
    return body


def _check_key(ctx: ServerContext, request: Request) -> None:
    if ctx.api_key is None or request.url.path in OPEN_PATHS:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), ctx.api_key.encode()):
        raise Unauthorized("invalid or missing API key: send 'Authorization: Bearer <key>'")


def build_app(ctx: ServerContext) -> Starlette:
    def endpoint(handler, *, body: bool):
        async def route(request: Request):
            try:
                _check_key(ctx, request)
                if not body:
                    return await handler(ctx, request)
                result = await handler(ctx, await _body(ctx, request), request.receive)
                if result is None:                     # the client went away; the request was aborted
                    return Response(status_code=499)
                return _json(result) if isinstance(result, msgspec.Struct) else result
            except APIError as err:
                ctx.metrics.on_rejected(err.status)
                return _error(err)
            except ClientDisconnect:
                return Response(status_code=499)
            except Exception as err:                   # a bug: say so in the API's shape, keep serving
                log.exception("unhandled error in %s", request.url.path)
                ctx.metrics.on_rejected(500)
                return _error(APIError(f"internal error: {type(err).__name__}: {err}"))
        return route

    async def not_found(request: Request, exc: HTTPException):
        if exc.status_code == 404:
            return _error(NotFound(f"no route {request.method} {request.url.path}"))
        err = APIError(exc.detail or "error")
        err.status, err.kind = exc.status_code, "BadRequestError" if exc.status_code < 500 else err.kind
        return _error(err)

    @asynccontextmanager
    async def lifespan(app):
        ctx.engine.start()
        try:
            yield
        finally:
            ctx.engine.stop()

    routes = [
        Route("/v1/completions", endpoint(create_completion, body=True), methods=["POST"]),
        Route("/v1/chat/completions", endpoint(create_chat_completion, body=True), methods=["POST"]),
        Route("/tokenize", endpoint(_tokenize, body=True), methods=["POST"]),
        Route("/detokenize", endpoint(_detokenize, body=True), methods=["POST"]),
        Route("/v1/models", endpoint(_models, body=False), methods=["GET"]),
        Route("/health", endpoint(_health, body=False), methods=["GET"]),
        Route("/metrics", endpoint(_metrics, body=False), methods=["GET"]),
        Route("/version", endpoint(_version, body=False), methods=["GET"]),
        Route("/ping", endpoint(_health, body=False), methods=["GET", "POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: not_found})


async def _models(ctx: ServerContext, request: Request) -> Response:
    card = {"id": ctx.model_name, "object": "model", "created": 0, "owned_by": "dsv4gen",
            "root": ctx.model_name, "parent": None, "max_model_len": ctx.max_model_len}
    return _json({"object": "list", "data": [card]})


async def _health(ctx: ServerContext, request: Request) -> Response:
    if ctx.engine.dead:
        raise EngineDead(f"the engine is not running: {ctx.engine.dead}")
    return Response(status_code=200)


async def _metrics(ctx: ServerContext, request: Request) -> Response:
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)


async def _version(ctx: ServerContext, request: Request) -> Response:
    return _json({"version": VERSION})


async def _tokenize(ctx: ServerContext, body: bytes, receive) -> Response:
    req = protocol.decode(body, protocol.TokenizeRequest)
    ctx.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise BadRequest("give exactly one of prompt or messages", param="prompt")
    if req.prompt is not None:
        tokens = ctx.tokenizer.encode(req.prompt)
    else:
        thinking = bool((req.chat_template_kwargs or {}).get("thinking", False))
        tokens = ctx.encode_chat(req.messages, thinking=thinking, tools=req.tools,
                                 add_generation_prompt=req.add_generation_prompt)
    strs = [ctx.text.text(t) for t in tokens] if req.return_token_strs else None
    return _json({"count": len(tokens), "max_model_len": ctx.max_model_len, "tokens": tokens, "token_strs": strs})


async def _detokenize(ctx: ServerContext, body: bytes, receive) -> Response:
    req = protocol.decode(body, protocol.DetokenizeRequest)
    ctx.check_model(req.model)
    bad = [t for t in req.tokens if not 0 <= t < ctx.vocab_size]
    if bad:
        raise BadRequest(f"token id {bad[0]} is outside the vocabulary (0..{ctx.vocab_size - 1})", param="tokens")
    return _json({"prompt": ctx.tokenizer.decode(req.tokens)})
