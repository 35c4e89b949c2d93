"""The OpenAPI document (`/schema/openapi.json`) as the server answers: bodies in msgspec's own JSON Schema of the
protocol Structs (the bounds the decoder enforces), each endpoint's error statuses with OpenAI's error body,
Retry-After where the server sends it, and `text/event-stream` beside JSON where a request may stream.
Handlers declare their statuses (`error_responses`, `streaming`); `publish(app, types)` puts the true
schemas in once the app is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Litestar
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import (
    OpenAPIHeader,
    OpenAPIMediaType,
    OpenAPIResponse,
    OpenAPIType,
    Operation,
    Reference,
    Schema,
)

from gateway.answers import ErrorBody

# what each error status means here; every one carries {"error": {"message", "type", "param", "code"}}
ERRORS = {
    400: "The request is invalid; `param` names the field at fault",
    401: "The API key is missing or incorrect (when [auth] keys are configured)",
    404: "No route or engine has this `model` (`model_not_found`)",
    408: "The request's headers or body did not arrive within [server] header_timeout_s / body_timeout_s",
    413: "The request body is larger than [server] max_body_bytes",
    415: "The request body is not JSON",
    429: "The key's requests or tokens per minute are spent; retry after Retry-After seconds",
    431: "The request headers are larger than [server] max_header_bytes",
    503: "Not ready, overloaded, shed by admission or shutting down; retry after Retry-After seconds",
}
# what the server itself answers, for any request, before or beside the handler
SERVER_ERRORS = (408, 431, 503)
RETRY_AFTER = OpenAPIHeader(schema=Schema(type=OpenAPIType.INTEGER, minimum=1),
                            description="Seconds to wait before retrying")
EVENT_STREAM = "text/event-stream"
REF = "#/components/schemas/{name}"


def error_responses(*statuses: int, body: type[msgspec.Struct] = ErrorBody) -> dict[int, ResponseSpec]:
    """Part of a handler's `responses=`: OpenAI's error body (or another API's, `body`) for each of `statuses`."""
    return {status: ResponseSpec(body, description=ERRORS[status], generate_examples=False)
            for status in statuses}


def streaming(chunk: type[msgspec.Struct], *, typed_events: bool = False) -> type[Operation]:
    """The operation class of an endpoint that answers SSE instead of JSON when the request says `"stream": true`:
    its 200 lists both media types. `typed_events`: each event is named by its type (the Responses and Messages
    APIs' streams), its `data` a `chunk`, errors included."""

    @dataclass
    class StreamingOperation(Operation):
        def __post_init__(self) -> None:
            self.responses["200"].content[EVENT_STREAM] = OpenAPIMediaType(schema=sse_event(chunk, typed_events))

    return StreamingOperation


def sse_event(chunk: type[msgspec.Struct], typed_events: bool = False) -> Schema:
    """One event of a stream (the event schema of Open API 3.2's `itemSchema`): `data:` holds a `chunk` as JSON,
    an error body if the request fails after its first chunk, or the closing `[DONE]`."""
    payload = Reference(REF.format(name=chunk.__name__)) if typed_events else Schema(one_of=[
        Reference(REF.format(name=chunk.__name__)), Reference(REF.format(name="ErrorBody"))])
    return Schema(type=OpenAPIType.OBJECT, required=["data"], properties={
        "event": Schema(type=OpenAPIType.STRING) if typed_events else Schema(type=OpenAPIType.STRING,
                                                                             const="message"),
        "data": Schema(one_of=[Schema(type=OpenAPIType.STRING, content_media_type="application/json",
                                      content_schema=payload),
                               Schema(type=OpenAPIType.STRING, const="[DONE]")])})


def publish(app: Litestar, types: list[type[msgspec.Struct]],
            error_shapes: dict[str, type[msgspec.Struct]] | None = None) -> None:
    """Make the app's OpenAPI document true before it is first served: `types`, ErrorBody and every Struct they
    reach get msgspec's schema (Litestar's drops bounds on optional fields), every operation lists the statuses
    the server answers by itself (in `error_shapes[path prefix]`'s body where another API's shape answers),
    and 429 and 503 carry Retry-After."""
    document = app.openapi_schema  # built once and cached by Litestar: edits made now are what it serves
    shapes = error_shapes or {}
    _, schemas = msgspec.json.schema_components([*types, ErrorBody, *shapes.values()], ref_template=REF)
    document.components.schemas.update(schemas)
    for path, path_item in (document.paths or {}).items():
        shape = next((body for prefix, body in shapes.items() if path.startswith(prefix)), ErrorBody)
        error_body = OpenAPIMediaType(schema=Reference(REF.format(name=shape.__name__)))
        for operation in (path_item.get, path_item.post, path_item.delete):
            if operation is None or operation.responses is None:
                continue
            for status, response in operation.responses.items():
                if isinstance(response, OpenAPIResponse) and _litestar_error(response):  # errors.py re-shapes it
                    operation.responses[status] = OpenAPIResponse(description=ERRORS[int(status)],
                                                                  content={"application/json": error_body})
            for status in SERVER_ERRORS:
                operation.responses.setdefault(str(status), OpenAPIResponse(
                    description=ERRORS[status], content={"application/json": error_body}))
            for status in ("429", "503"):
                if status in operation.responses:
                    operation.responses[status].headers = {"Retry-After": RETRY_AFTER}


def bound_parameter(app: Litestar, path: str, name: str, maximum: int) -> None:
    """Publish a bound the configuration sets (not known when the handler is declared) on parameter `name` of
    every operation on `path`."""
    path_item = (app.openapi_schema.paths or {}).get(path)
    for operation in (path_item.get, path_item.post) if path_item is not None else ():
        for parameter in (operation.parameters or []) if operation is not None else ():
            if getattr(parameter, "name", None) == name and isinstance(parameter.schema, Schema):
                schema = parameter.schema
                for option in schema.one_of or [schema]:  # an optional parameter: oneOf [integer, null]
                    if isinstance(option, Schema) and option.type == OpenAPIType.INTEGER:
                        option.maximum = maximum


def amend(app: Litestar, edit: Callable[[dict[str, Any]], None]) -> None:
    """Apply `edit` (idempotent) to the component schemas after the app is built (once the engines are loaded),
    in the document and in the copy Litestar keeps once it has served it."""
    edit(app.openapi_schema.components.schemas)
    served = app.plugins.get("OpenAPIPlugin").provide_openapi_schema()  # the plugin's public name and method
    edit(served["components"]["schemas"])


def _litestar_error(response: OpenAPIResponse) -> bool:
    """Whether Litestar documented this answer in its own error shape ({status_code, detail, extra})."""
    media = (response.content or {}).get("application/json")
    schema = media.schema if media is not None else None
    return isinstance(schema, Schema) and set(schema.properties or {}) == {"status_code", "detail", "extra"}
