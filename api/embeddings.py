"""POST /v1/embeddings: OpenAI's embeddings endpoint, for a model served with the
pooling runner (``--runner pooling`` / ``--task embed``).

Each input (a string, a list of token ids, or a batch of either) is one request
of the engine, pooled by the checkpoint's rule (api docs: docs/http-api.md,
"Embeddings"); all of a body's inputs are submitted at once and batched with
whatever else runs. The vectors come back as JSON floats or, with
``encoding_format: "base64"``, as the base64 of their float32 little-endian bytes
(what the openai SDK decodes). A client that goes away aborts every input not
finished. A server without the pooling runner answers 400, saying how to serve
one.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol, TypeVar

import msgspec
import trio
from quart_trio.wrappers.response import TrioResponse as Response

from trio_llm.actors.errors import RequestRejected
from trio_llm.actors.messages import PoolingParams, embedding_values
from trio_llm.api.engine import EmbeddingOutput
from trio_llm.api.request_fields import Refusal
from trio_llm.api.stats_log import log_request

if TYPE_CHECKING:
    from quart_trio import QuartTrio

    from trio_llm.api.engine import Engine

BodyT = TypeVar("BodyT", bound=msgspec.Struct)


class Handlers(Protocol):
    """What this module uses of the app's handlers (api/server.py's OpenAIServer,
    which registers these routes: a Protocol, so that this module does not
    import it back)."""

    engine: Engine
    model_name: str
    _conversion_threads: trio.CapacityLimiter

    async def _decoded_body(self, kind: type[BodyT],
                            refused: dict[str, Refusal] | None = None) -> BodyT: ...

    def _check_model(self, model: str | None) -> None: ...

    def _json(self, body: msgspec.Struct, *, status: int = 200) -> Response: ...

    @property
    def config(self) -> LogSettings: ...


class LogSettings(Protocol):
    """The server settings this module reads (api/server.py's ServerConfig)."""

    @property
    def disable_log_requests(self) -> bool: ...


EMBEDDINGS_PATH = "/v1/embeddings"
# OpenAI's bound on the inputs of one request; each is a request of the engine.
MAX_EMBEDDING_INPUTS = 2048
# A response with more values than this is built in a worker thread: encoding a
# float costs about 50 ns, so this much stays under a millisecond on the loop.
MAX_INLINE_VALUES = 16 * 1024


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """OpenAI's request fields, and vLLM's extra ones (``truncate_prompt_tokens``,
    ``add_special_tokens``, ``priority``, ``normalize``)."""

    # a string, a list of strings, a list of token ids, or a list of such lists:
    # checked by ``embedding_inputs`` (msgspec takes one array type in a union)
    input: str | list[Any]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    add_special_tokens: bool = True
    priority: int = 0
    normalize: bool | None = None


_SERVER_REQUEST_IDS = Refusal((), "the server names each request itself (the response's id)")
REFUSED_EMBEDDING_FIELDS: dict[str, Refusal] = {
    "request_id": _SERVER_REQUEST_IDS,
    "messages": Refusal((), "embeddings of a conversation are not supported; send input"),
    "mm_processor_kwargs": Refusal((), "trio-llm serves text models only"),
    "embed_dtype": Refusal(("float32",), "vectors are float32"),
    "endianness": Refusal(("native", "little"), "base64 vectors are little-endian"),
    "use_activation": Refusal((), "embedding models have no activation to apply"),
}


class EmbeddingData(msgspec.Struct, kw_only=True):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    """OpenAI's response; ``id`` and ``created`` as vLLM adds them."""

    id: str
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
    object: str = "list"


def register_routes(app: QuartTrio, api: Handlers) -> None:
    """Serve POST /v1/embeddings from ``app``, with ``api``'s engine and settings."""
    async def create_embeddings() -> Response:
        return await respond(api)

    app.add_url_rule(EMBEDDINGS_PATH, view_func=create_embeddings, methods=["POST"],
                     endpoint=f"POST {EMBEDDINGS_PATH}")


async def respond(api: Handlers) -> Response:
    """Decode, check, embed every input (aborted if the client leaves), answer."""
    body = await api._decoded_body(EmbeddingRequest, REFUSED_EMBEDDING_FIELDS)
    api._check_model(body.model)
    engine = api.engine
    if engine.pooling is None:
        raise RequestRejected(
            f"model {api.model_name!r} is not served as an embedding model: start the server "
            f"with --runner pooling (or --task embed) to serve {EMBEDDINGS_PATH}", param="model")
    inputs = embedding_inputs(body.input)
    pooling = PoolingParams(dimensions=body.dimensions, normalize=body.normalize,
                            truncate_prompt_tokens=body.truncate_prompt_tokens,
                            add_special_tokens=body.add_special_tokens)
    response_id = f"embd-{uuid.uuid4().hex}"
    outputs = await engine.embed_many(inputs, pooling, priority=body.priority,
                                      request_id=response_id)
    if not api.config.disable_log_requests:
        num_prompt_tokens = sum(output.num_prompt_tokens for output in outputs)
        log_request(f"POST {EMBEDDINGS_PATH}", 200, response_id,
                    f"{len(outputs)} inputs, {num_prompt_tokens} prompt tokens")
    build = response_builder(body, outputs, response_id, api.model_name)
    num_values = sum(len(output.data) for output in outputs) // 4
    if num_values <= MAX_INLINE_VALUES:
        return api._json(build())
    return api._json(await trio.to_thread.run_sync(build, limiter=api._conversion_threads))


def response_builder(body: EmbeddingRequest, outputs: list[EmbeddingOutput], response_id: str,
                     model: str) -> Any:
    """A function building the response (run in a worker thread when large)."""
    def build() -> EmbeddingResponse:
        data = [EmbeddingData(index=index, embedding=_encoded(output.data, body.encoding_format))
                for index, output in enumerate(outputs)]
        num_prompt_tokens = sum(output.num_prompt_tokens for output in outputs)
        return EmbeddingResponse(id=response_id, created=int(time.time()), model=model,
                                 data=data, usage=EmbeddingUsage(prompt_tokens=num_prompt_tokens,
                                                                 total_tokens=num_prompt_tokens))
    return build


def _encoded(data: bytes, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(data).decode("ascii")
    return embedding_values(data)


def embedding_inputs(value: str | list[Any]) -> list[str | list[int]]:
    """The inputs of a request, as text or token ids: one string, one list of ids, or
    a list of either (not mixed). Empty input is refused, as OpenAI does."""
    if isinstance(value, str):
        return [_checked_text(value, "input")]
    if not value:
        raise RequestRejected("input must not be an empty list", param="input")
    if all(_is_token_id(item) for item in value):
        return [list(value)]
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise RequestRejected(f"at most {MAX_EMBEDDING_INPUTS} inputs per request, not "
                              f"{len(value)}", param="input")
    kind = str if isinstance(value[0], str) else list
    inputs: list[str | list[int]] = []
    for index, item in enumerate(value):
        param = f"input[{index}]"
        if kind is str and isinstance(item, str):
            inputs.append(_checked_text(item, param))
        elif kind is list and isinstance(item, list) and all(map(_is_token_id, item)):
            if not item:
                raise RequestRejected("an input's token ids must not be empty", param=param)
            inputs.append(list(item))
        else:
            raise RequestRejected("input must be a string, a list of token ids, or a list of "
                                  "strings or of token-id lists (not mixed)", param=param)
    return inputs


def _checked_text(text: str, param: str) -> str:
    if not text:
        raise RequestRejected("input must not be an empty string", param=param)
    return text


def _is_token_id(item: object) -> bool:
    return isinstance(item, int) and not isinstance(item, bool)
