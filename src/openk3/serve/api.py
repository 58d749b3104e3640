"""The FastAPI application: routes, OpenAI-style errors, and the engine thread's lifetime.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text format). Malformed JSON, a body that is not an object and every
validation failure answer 400 with ``{"error": {message, type, param, code}}``; a body over
``ServingConfig.max_request_bytes`` 413 before it is read (:func:`openk3.serve.protocol.read_body`); a
model this server does not serve (``code: "model_not_found"``) and unknown routes 404, unexpected exceptions
500 in the same shape.
"""

from __future__ import annotations

import contextlib
import logging
import time

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from openk3.serve.metrics import CONTENT_TYPE
from openk3.serve.openai_serving import OpenAIServing
from openk3.serve.protocol import APIError, json_object, read_body

logger = logging.getLogger("openk3.serve")


def _error(status: int, message: str, type: str, param=None, code=None, headers=None) -> JSONResponse:
    return JSONResponse(
        APIError(status, message, type, param, code).body(), status_code=status, headers=headers
    )


def build_app(serving: OpenAIServing) -> FastAPI:
    """The app for one model; the engine thread starts and stops with the app's lifespan."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        serving.engine.start()
        try:
            yield
        finally:
            serving.engine.shutdown()
            serving.engine.stop()
            serving.close()

    app = FastAPI(title="openk3", lifespan=lifespan)
    app.state.serving = serving
    created = int(time.time())

    async def _json_body(http: HTTPRequest) -> dict:
        return json_object(await read_body(http, serving.config.max_request_bytes))

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, e: RequestValidationError):
        return _error(400, str(e.errors()[0].get("msg", "invalid request")), "invalid_request_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        return _error(
            e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error"
        )

    @app.exception_handler(Exception)
    async def _unexpected(request, e: Exception):
        logger.exception("unhandled error")
        return _error(500, f"internal error: {type(e).__name__}", "server_error")

    @app.get("/health")
    async def health():
        return {"status": "ok", "max_request_bytes": serving.config.max_request_bytes}

    def card() -> dict:
        return {
            "id": serving.config.model_name,
            "object": "model",
            "created": created,
            "owned_by": "openk3",
            "max_model_len": serving.config.max_model_len,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):  # OpenAI's retrieve: the card, or its 404
        if model_id != serving.config.model_name:
            raise APIError(
                404,
                f"The model {model_id!r} does not exist; this server serves {serving.config.model_name!r}",
                param="model",
                code="model_not_found",
            )
        return card()

    @app.get("/metrics")
    async def metrics():
        return Response(serving.metrics.render(serving.engine.stats()), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        return await serving.completions(await _json_body(http), http)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        return await serving.chat(await _json_body(http), http)

    return app
