"""The OpenAPI 3.1 description served at ``/openapi.json``, generated from the response
models the handlers build (:mod:`cloud_gateway.http.models`) and the route table below, so
the two cannot drift apart: a route of :func:`cloud_gateway.http.api.make_app` missing
here fails tests/unit/gateway/http/test_openapi.py, a key a handler sends that its model lacks fails
mypy, and tests/integration/test_api_schemathesis.py checks a live gateway's answers
against this document."""

from __future__ import annotations

import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, NotRequired, Required, Union, is_typeddict

from cloud_gateway import __version__
from cloud_gateway.exposition.shards import MAX_SHARDS
from cloud_gateway.http.models import (
    BieNode,
    ErrorBody,
    GatewayList,
    NodeDetail,
    NodeList,
    NodeState,
    TargetGroup,
)

JSON = "application/json"
TEXT = "text/plain"
HTML = "text/html"
OPENMETRICS = "application/openmetrics-text"
_PRIMITIVES: dict[object, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


class SchemaBuilder:
    """JSON Schema (OpenAPI 3.1 dialect) of type hints: str, int, float, bool, None,
    ``X | None``, ``list[X]``, ``dict[str, X]``, ``Literal[...]``, ``Annotated[X, "text"]``
    (a description) and TypedDicts, each of which becomes ``#/components/schemas/Name``
    (closed: a key the model lacks is a schema violation)."""

    def __init__(self) -> None:
        self.components: dict[str, dict[str, Any]] = {}

    def schema(self, hint: object) -> dict[str, Any]:
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin is Annotated:
            out = self.schema(args[0])
            text = "; ".join(a for a in args[1:] if isinstance(a, str))
            return out | {"description": text} if text else out
        if origin in (Required, NotRequired):
            return self.schema(args[0])
        if hint is type(None):
            return {"type": "null"}
        if hint is object or hint is Any:
            return {}
        if hint in _PRIMITIVES:
            return {"type": _PRIMITIVES[hint]}
        if origin in (Union, types.UnionType):
            return self._union(args)
        if origin is Literal:
            kinds = {_PRIMITIVES[type(a)] for a in args}
            (kind,) = kinds  # one JSON type per enum
            return {"type": kind, "enum": list(args)}
        if origin is list:
            return {"type": "array", "items": self.schema(args[0])}
        if origin is dict and args[0] is str:
            return {"type": "object", "additionalProperties": self.schema(args[1])}
        if isinstance(hint, type) and is_typeddict(hint):
            return self._ref(hint)
        raise TypeError(f"no JSON schema for {hint!r}")

    def _union(self, args: tuple[object, ...]) -> dict[str, Any]:
        parts = [self.schema(a) for a in args]
        if all(set(p) <= {"type", "description"} and isinstance(p["type"], str) for p in parts):
            # int | None: {"type": ["integer", "null"]}, with the description of either
            out: dict[str, Any] = {"type": [p["type"] for p in parts]}
            text = "; ".join(p["description"] for p in parts if "description" in p)
            return out | {"description": text} if text else out
        return {"anyOf": parts}

    def _ref(self, model: type) -> dict[str, Any]:
        name = model.__name__
        if name not in self.components:
            self.components[name] = {}  # a placeholder first: a model may refer to itself
            hints = typing.get_type_hints(model, include_extras=True)
            # From the hints: with string annotations, Python 3.11 puts NotRequired keys in
            # __required_keys__ too.
            total: frozenset[str] = getattr(model, "__required_keys__", frozenset())
            required = sorted(
                key
                for key, hint in hints.items()
                if typing.get_origin(hint) is Required
                or (key in total and typing.get_origin(hint) is not NotRequired)
            )
            body: dict[str, Any] = {
                "type": "object",
                "properties": {key: self.schema(hint) for key, hint in hints.items()},
                "required": required,
                "additionalProperties": False,
            }
            if model.__doc__ and not model.__doc__.startswith(f"{name}("):
                body["description"] = " ".join(model.__doc__.split())
            self.components[name] = body
        return {"$ref": f"#/components/schemas/{name}"}


@dataclass(frozen=True)
class Param:
    name: str
    where: Literal["query", "path"]
    schema: dict[str, Any]
    description: str = ""


@dataclass(frozen=True)
class Reply:
    """One status of an operation: the model (a type hint) of its JSON body, and its media
    types (text and HTML bodies are strings; the node's own answer: ``media`` empty)."""

    description: str
    model: object = None
    media: tuple[str, ...] = (JSON,)


@dataclass(frozen=True)
class Route:
    path: str
    summary: str
    replies: dict[int | str, Reply]
    # api: bearer token or basic user, always; optional: only with http.protect_metrics;
    # open: never asked.
    auth: Literal["api", "optional", "open"] = "api"
    params: tuple[Param, ...] = ()
    methods: tuple[str, ...] = ("get",)
    tags: tuple[str, ...] = ()


def _text(description: str) -> Reply:
    return Reply(description, media=(TEXT,))


ERROR = Reply("refused or invalid; the body says why", ErrorBody)
_UNAUTHORISED = Reply("no or malformed credentials, or a wrong basic password", ErrorBody)
_FORBIDDEN = Reply(
    "a token that is not accepted, or none configured (the API is closed)", ErrorBody
)
_MALFORMED = Reply("a malformed HTTP request (the HTTP server's text answer)", media=(TEXT,))
_NODE = Param("node", "path", {"type": "string"}, "the node's name")
_SHARDS = Param(
    "shards",
    "query",
    {"type": "integer", "minimum": 1, "maximum": MAX_SHARDS},
    "how many shards the fleet is split into (default 1)",
)
_SHARD = Param(
    "shard",
    "query",
    {"type": "integer", "minimum": 0, "maximum": MAX_SHARDS - 1},
    "only the nodes whose name hashes to this shard (0..shards-1); shard and shards go "
    "together. The gateway's own gpurelay_gateway_* families are in shard 0; the shards "
    "together hold every series once",
)
# http.proxy_methods' default; an operator may list POST, PUT, ... too (else 405).
PROXY_METHODS = ("get", "head")

ROUTES: tuple[Route, ...] = (
    Route(
        "/metrics",
        "All nodes' latest series, node-stamped (Prometheus text, or OpenMetrics when the "
        "Accept header asks for it; gzip when Accept-Encoding allows)",
        {200: Reply("the exposition", media=(TEXT, OPENMETRICS)), 400: ERROR},
        auth="optional",
        params=(_SHARD, _SHARDS),
        tags=("metrics",),
    ),
    Route(
        "/v1/collect",
        "Baidu BIE accelerator map: node -> GPU memory summary (online nodes)",
        {200: Reply("node name -> summary", dict[str, BieNode])},
        auth="optional",
        tags=("metrics",),
    ),
    Route(
        "/api/v1/nodes",
        "List nodes (with [cluster]: the whole fleet, each with its gateway)",
        {200: Reply("the nodes", NodeList), 400: ERROR},
        params=(
            Param("state", "query", SchemaBuilder().schema(NodeState), "only this state"),
            Param("domain", "query", {"type": "string"}, "only this domain"),
        ),
        tags=("nodes",),
    ),
    Route(
        "/api/v1/nodes/{node}",
        "One node: details, GPUs, recent errors",
        {200: Reply("the node", NodeDetail), 404: ERROR},
        params=(_NODE,),
        tags=("nodes",),
    ),
    Route(
        "/api/v1/gateways",
        "The cluster's gateways (one gateway: itself)",
        {200: Reply("the gateways", GatewayList)},
        tags=("cluster",),
    ),
    Route(
        "/api/v1/sd",
        "Prometheus http_sd: the online nodes' published endpoints (tokens: http.sd_tokens, "
        "else http.tokens; open with http.protect_sd = false)",
        {200: Reply("target groups", list[TargetGroup])},
        tags=("discovery",),
    ),
    Route(
        "/api/v1/sd/metrics",
        "Prometheus http_sd of the gateways' own /metrics: per live gateway, one target per "
        "shard (labels __param_shard, __param_shards, gateway, shard); shards=1: one target "
        "per gateway, the whole body",
        {200: Reply("target groups", list[TargetGroup]), 400: ERROR},
        params=(_SHARDS,),
        tags=("discovery",),
    ),
    Route(
        "/proxy/{node}/{port}/{path}",
        "Relay a request to a port on a node through its tunnel (tokens: http.proxy_tokens, "
        "else http.tokens). The answer is the node's: its status, content type and body",
        {
            "default": Reply("the node's answer, passed through", media=()),
            400: _text("a port that is not 1..65535, or a request that cannot be relayed"),
            403: Reply(
                "a token that is not accepted or none configured (JSON), a port the node "
                "does not publish, or a request another site's page sent (text)",
                ErrorBody,
                media=(JSON, TEXT),
            ),
            404: _text("unknown node (or the node's own 404)"),
            405: _text("a method that http.proxy_methods does not list (default GET, HEAD)"),
            502: _text("the node refused the port or sent no valid HTTP response"),
            503: _text("the node is not connected (or the node's own 503)"),
            504: _text("the node did not answer in time"),
        },
        params=(
            _NODE,
            Param("port", "path", {"type": "integer", "minimum": 1, "maximum": 65535}),
            Param("path", "path", {"type": "string"}, "the path on the node (may hold '/')"),
        ),
        methods=PROXY_METHODS,
        tags=("proxy",),
    ),
    Route(
        "/ui",
        "The operator page: the fleet at a glance (HTML; an API token is also accepted as "
        "the Basic password)",
        {200: Reply("the page", media=(HTML,))},
        tags=("ui",),
    ),
    Route(
        "/ui/nodes/{node}",
        "The operator page of one node (HTML)",
        {200: Reply("the page", media=(HTML,)), 404: Reply("unknown node", media=(HTML,))},
        params=(_NODE,),
        tags=("ui",),
    ),
    Route("/healthz", "The process is alive", {200: _text("ok")}, auth="open"),
    Route(
        "/health", "The process is alive (dcgm-exporter's name)", {200: _text("ok")}, auth="open"
    ),
    Route(
        "/readyz",
        "Listeners are bound, the gateway is not shutting down and (with [cluster]) not fenced",
        {200: _text("ready"), 503: _text("not ready, and why")},
        auth="open",
    ),
    Route(
        "/openapi.json",
        "This document",
        {200: Reply("OpenAPI 3.1", dict[str, object])},
        auth="open",
    ),
)

_CHALLENGE = {
    "WWW-Authenticate": {
        "description": "Bearer and/or Basic challenges",
        "required": True,
        "schema": {"type": "string"},
    }
}
_SECURITY: list[dict[str, list[str]]] = [{"bearer": []}, {"basic": []}]


@dataclass
class _Builder:
    schemas: SchemaBuilder = field(default_factory=SchemaBuilder)

    def operation(self, route: Route, method: str) -> dict[str, Any]:
        replies = dict(route.replies)
        if route.auth != "open":  # the route's own 401/403 say more
            replies = {401: _UNAUTHORISED, 403: _FORBIDDEN, **replies}
        # A request aiohttp cannot parse (a bad Transfer-Encoding, say) gets its own text
        # 400 before any handler runs, whatever the path.
        own = replies.get(400)
        if own is None:
            replies[400] = _MALFORMED
        elif TEXT not in own.media:
            replies[400] = Reply(f"{own.description}; or {_MALFORMED.description}", own.model,
                                 (*own.media, TEXT))  # fmt: skip
        op: dict[str, Any] = {
            "summary": route.summary,
            "operationId": _operation_id(route.path, method),
            "responses": {
                str(status): self.response(reply, challenge=status == 401)
                for status, reply in sorted(replies.items(), key=lambda kv: str(kv[0]))
            },
        }
        if route.tags:
            op["tags"] = list(route.tags)
        if route.params:
            op["parameters"] = [self.parameter(p) for p in route.params]
        if route.auth == "api":
            op["security"] = _SECURITY
        elif route.auth == "optional":
            op["security"] = [{}, *_SECURITY]
        return op

    def response(self, reply: Reply, *, challenge: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"description": reply.description}
        if reply.media:  # the model describes the JSON; any other body is text
            model = self.schemas.schema(reply.model) if reply.model is not None else None
            out["content"] = {
                media: {"schema": model if model and media == JSON else {"type": "string"}}
                for media in reply.media
            }
        if challenge:
            out["headers"] = _CHALLENGE
        return out

    def parameter(self, param: Param) -> dict[str, Any]:
        out: dict[str, Any] = {"name": param.name, "in": param.where, "schema": param.schema}
        if param.where == "path":
            out["required"] = True
        if param.description:
            out["description"] = param.description
        return out


def _operation_id(path: str, method: str) -> str:
    words = [w.strip("{}") for w in path.split("/") if w and w not in ("api", "v1")]
    return "_".join([method, *(w.replace(".", "_") for w in words)])


@functools.cache
def document() -> dict[str, Any]:
    """The whole OpenAPI document (built once; the result must not be changed)."""
    builder = _Builder()
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        item = paths.setdefault(route.path, {})
        for method in route.methods:
            item[method] = builder.operation(route, method)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "edge-gpu-relay cloud gateway",
            "version": __version__,
            "description": "Operator API, Prometheus service discovery, the node proxy and "
            "the gateway's own endpoints. /api/* takes a bearer token of http.tokens (or a "
            "basic_auth_users user of http.web_config_file); /metrics and /v1/collect do "
            "too with http.protect_metrics.",
        },
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "basic": {"type": "http", "scheme": "basic"},
            },
            "schemas": dict(sorted(builder.schemas.components.items())),
        },
        "paths": paths,
    }
