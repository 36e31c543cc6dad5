"""The HTTP surface: OpenAI routes, health, metrics, API key check, OpenAI-shaped errors."""
import hmac
import logging
import time
from collections.abc import Awaitable, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from cluster.protocol import SESSION_HEADER, APIError
from cluster.serving import OpenAIServing, internal_error

logger = logging.getLogger("ray.serve.prefixserve.api")


def build_api(serving: OpenAIServing, *, render_metrics: Callable[[], Awaitable[bytes]],
              api_key: str | None = None, max_body_bytes: int | None = None,
              routed_request_id_header: str | None = None) -> FastAPI:
    """The FastAPI app. With api_key set, /v1 routes want "Authorization: Bearer <api_key>"; with
    max_body_bytes set, larger request bodies get 413; with routed_request_id_header set, a request is served
    under the id that header gives (the one its router booked it under), if it has one."""
    app = FastAPI(title="prefixserve", openapi_url=None)

    def routed_request_id(request: Request) -> str | None:
        return None if routed_request_id_header is None else request.headers.get(routed_request_id_header)

    async def authorize(request: Request) -> None:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError("Incorrect API key provided.", status_code=401, code="invalid_api_key")

    v1 = [] if api_key is None else [Depends(authorize)]  # FastAPI solves even a no-op dependency per request

    @app.post("/v1/completions", dependencies=v1)
    async def completions(request: Request) -> Response:
        arrival_time = time.monotonic()
        return await serving.create_completion(await _read_body(request, max_body_bytes), arrival_time,
                                               request.headers.get(SESSION_HEADER), routed_request_id(request))

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(request: Request) -> Response:
        arrival_time = time.monotonic()
        return await serving.create_chat_completion(await _read_body(request, max_body_bytes), arrival_time,
                                                    request.headers.get(SESSION_HEADER), routed_request_id(request))

    @app.get("/v1/models", dependencies=v1)
    async def models() -> JSONResponse:
        return JSONResponse(serving.list_models())

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await render_metrics(), media_type=CONTENT_TYPE_LATEST)

    _add_error_handlers(app)
    return app


async def _read_body(request: Request, limit: int | None) -> bytes:
    """The body, read no further than limit bytes."""
    declared = request.headers.get("content-length", "")
    if limit is not None and declared.isdigit() and int(declared) > limit:
        raise _body_too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if limit is not None and len(body) > limit:
            raise _body_too_large(limit)
    return bytes(body)


def _body_too_large(limit: int) -> APIError:
    return APIError(f"The request body is larger than {limit} bytes.", status_code=413, code="request_too_large")


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return await api_error(request, APIError(str(exc.detail), status_code=exc.status_code))

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return await api_error(request, internal_error())
