"""The server's OpenAPI 3.1 document, generated from the msgspec request and
response types (``msgspec.json.schema_components``): the schema a client or a
fuzzer sees is the one the server decodes with, bounds included."""

from __future__ import annotations

from typing import Any

import msgspec

from trio_llm.api import embeddings, protocol

REF_TEMPLATE = "#/components/schemas/{name}"
JSON = "application/json"
# Errors every JSON endpoint can answer with, all in the OpenAI error shape.
ERROR_STATUSES = {
    "400": "invalid request: a field, the body or its Content-Type",
    "401": "missing or wrong API key",
    "404": "the request names a model this server does not serve",
    "413": "body over --max-body-bytes (the connection is closed)",
    "503": "queue full or shutting down (with Retry-After)",
}


def _ref(kind: type) -> dict[str, str]:
    return {"$ref": REF_TEMPLATE.format(name=kind.__name__)}


def _errors(kinds: dict[type, str]) -> dict[str, Any]:
    responses: dict[str, Any] = {
        status: {"description": description,
                 "content": {JSON: {"schema": _ref(protocol.ErrorResponse)}}}
        for status, description in ERROR_STATUSES.items()}
    for kind, description in kinds.items():
        responses["200"] = {"description": description, "content": {JSON: {"schema": _ref(kind)}}}
    return responses


def _post(summary: str, body: type, response: type, *, streams: bool = False) -> dict[str, Any]:
    responses = _errors({response: "the result"})
    if streams:
        responses["200"]["content"]["text/event-stream"] = {
            "schema": {"type": "string", "description": "SSE chunks, then data: [DONE]"}}
    return {"post": {"summary": summary,
                     "requestBody": {"required": True,
                                     "content": {JSON: {"schema": _ref(body)}}},
                     "responses": responses}}


def _get(summary: str, content: dict[str, Any], *, error_statuses: tuple[str, ...] = ()
         ) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": {"description": summary, "content": content}}
    for status in error_statuses:
        responses[status] = {"description": ERROR_STATUSES[status],
                             "content": {JSON: {"schema": _ref(protocol.ErrorResponse)}}}
    return {"get": {"summary": summary, "responses": responses}}


def _with_path_parameter(operation: dict[str, Any], name: str) -> dict[str, Any]:
    operation["get"]["parameters"] = [{"name": name, "in": "path", "required": True,
                                       "schema": {"type": "string"}}]
    return operation


def openapi_document(title: str) -> dict[str, Any]:
    """The whole document; ``title`` names the served model."""
    kinds: list[type] = [protocol.CompletionRequest, protocol.ChatCompletionRequest,
                         protocol.TokenizeRequest, protocol.DetokenizeRequest,
                         protocol.CompletionResponse, protocol.ChatCompletionResponse,
                         protocol.ChatCompletionChunk, protocol.ModelList,
                         protocol.TokenizeResponse, protocol.DetokenizeResponse,
                         protocol.ErrorResponse, protocol.VersionResponse,
                         embeddings.EmbeddingRequest, embeddings.EmbeddingResponse]
    _, components = msgspec.json.schema_components(kinds, ref_template=REF_TEMPLATE)
    paths = {
        "/v1/completions": _post("Create a completion", protocol.CompletionRequest,
                                 protocol.CompletionResponse, streams=True),
        "/v1/chat/completions": _post("Create a chat completion",
                                      protocol.ChatCompletionRequest,
                                      protocol.ChatCompletionResponse, streams=True),
        embeddings.EMBEDDINGS_PATH: _post("Create embeddings (a model served with --runner "
                                          "pooling)", embeddings.EmbeddingRequest,
                                          embeddings.EmbeddingResponse),
        "/tokenize": _post("Tokenize a prompt or a conversation", protocol.TokenizeRequest,
                           protocol.TokenizeResponse),
        "/detokenize": _post("Decode token ids", protocol.DetokenizeRequest,
                             protocol.DetokenizeResponse),
        "/v1/models": _get("The served model", {JSON: {"schema": _ref(protocol.ModelList)}},
                           error_statuses=("401",)),
        "/v1/models/{model_id}": _with_path_parameter(
            _get("The served model's card, by its name",
                 {JSON: {"schema": _ref(protocol.ModelCard)}}, error_statuses=("401", "404")),
            "model_id"),
        "/health": _get("200 while the engine serves (503 draining or dead)", {},
                        error_statuses=("503",)),
        "/metrics": _get("Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}}),
        "/version": _get("trio-llm's version", {JSON: {"schema": _ref(protocol.VersionResponse)}}),
        "/ping": _get("/health by vLLM's (and SageMaker's) other name", {},
                      error_statuses=("503",)),
    }
    return {"openapi": "3.1.0",
            "info": {"title": f"trio-llm serving {title}", "version": "1"},
            "paths": paths,
            "components": {"schemas": components}}
