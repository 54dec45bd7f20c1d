"""``/openapi.json`` is generated from the response models and the route table: every route
of make_app is in it, nothing else is, it is a valid OpenAPI 3.1 document, and its schemas
are the models' (a key a model declares is in the schema, and the schema is closed)."""

from __future__ import annotations

import typing
from typing import Any, Literal, NotRequired, TypedDict

import jsonschema
import pytest
import schemathesis

from cloud_gateway.exposition.body import Exposition
from cloud_gateway.http import models as api_models
from cloud_gateway.http.api import HttpState, make_app
from cloud_gateway.http.openapi import PROXY_METHODS, SchemaBuilder, document
from cloud_gateway.registry.store import Registry


def _routes() -> set[tuple[str, str]]:
    registry = Registry()
    app = make_app(HttpState(registry, Exposition(registry), frozenset({"t"})))
    routes = set()
    for route in app.router.routes():
        assert route.resource is not None
        path, method = route.resource.canonical, route.method.lower()
        if method == "*":
            routes |= {(path, m) for m in PROXY_METHODS}
        elif method != "head":  # aiohttp's HEAD of each GET
            routes.add((path, method))
    return routes


def _documented() -> set[tuple[str, str]]:
    return {(path, method) for path, item in document()["paths"].items() for method in item}


def test_every_route_is_documented() -> None:
    missing = _routes() - _documented()
    assert not missing, f"routes of make_app missing from /openapi.json: {sorted(missing)}"


def test_every_documented_operation_is_a_route() -> None:
    stale = _documented() - _routes()
    assert not stale, f"/openapi.json documents what make_app does not serve: {sorted(stale)}"


def test_the_document_is_valid_openapi() -> None:
    doc = document()
    schema = schemathesis.openapi.from_dict(doc)
    schema.validate()  # against the OpenAPI 3.1 meta-schema
    operations = [op.ok() for op in schema.get_all_operations()]  # every $ref resolves
    assert len(operations) == len(_documented())
    for name, component in doc["components"]["schemas"].items():
        jsonschema.Draft202012Validator.check_schema(component), name
    ids = [op["operationId"] for item in doc["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids))


def test_the_issue_s_missing_fields_and_paths_are_there() -> None:
    doc = document()
    detail = doc["components"]["schemas"]["NodeDetail"]["properties"]
    for key in ("published", "gpus", "recent_errors", "last_disconnect_reason", "gateway"):
        assert key in detail, key
    summary = doc["components"]["schemas"]["NodeSummary"]["properties"]
    assert summary["certificate_expires"]["type"] == ["integer", "null"]
    required = doc["components"]["schemas"]["NodeSummary"]["required"]
    assert "gateway" not in required and "last_disconnect_reason" not in required
    assert "name" in required and "certificate_expires" in required
    assert {"/api/v1/sd", "/api/v1/sd/metrics", "/proxy/{node}/{port}/{path}"} <= set(doc["paths"])
    shard = doc["paths"]["/metrics"]["get"]["parameters"]
    assert [(p["name"], p["schema"]["minimum"]) for p in shard] == [("shard", 0), ("shards", 1)]


@pytest.mark.parametrize(
    "model",
    [m for m in vars(api_models).values() if isinstance(m, type) and typing.is_typeddict(m)],
)
def test_a_model_s_schema_has_each_of_its_keys_and_no_other(model: type) -> None:
    builder = SchemaBuilder()
    ref = builder.schema(model)
    schema = builder.components[ref["$ref"].rpartition("/")[2]]
    assert set(schema["properties"]) == set(typing.get_type_hints(model))
    hints = typing.get_type_hints(model, include_extras=True)
    optional = {k for k, h in hints.items() if typing.get_origin(h) is NotRequired}
    assert set(schema["required"]) == set(hints) - optional
    assert schema["additionalProperties"] is False


class _Inner(TypedDict):
    v: float


class _Outer(TypedDict):
    kind: Literal["a", "b"]
    n: int | None
    inner: _Inner | None
    by_name: dict[str, list[_Inner]]
    maybe: NotRequired[bool]


def test_the_schema_builder_on_each_kind_of_hint() -> None:
    builder = SchemaBuilder()
    assert builder.schema(_Outer) == {"$ref": "#/components/schemas/_Outer"}
    outer = builder.components["_Outer"]
    inner_ref = {"$ref": "#/components/schemas/_Inner"}
    assert outer["properties"] == {
        "kind": {"type": "string", "enum": ["a", "b"]},
        "n": {"type": ["integer", "null"]},
        "inner": {"anyOf": [inner_ref, {"type": "null"}]},
        "by_name": {
            "type": "object",
            "additionalProperties": {"type": "array", "items": inner_ref},
        },
        "maybe": {"type": "boolean"},
    }
    assert outer["required"] == ["by_name", "inner", "kind", "n"]
    with pytest.raises(TypeError, match="no JSON schema"):
        builder.schema(set[int])


def _validate(instance: Any, model: object) -> None:
    builder = SchemaBuilder()
    root = builder.schema(model)
    defs: dict[str, Any] = {"components": {"schemas": builder.components}}
    jsonschema.Draft202012Validator({**root, **defs}).validate(instance)


def test_a_body_with_a_key_its_model_lacks_fails_the_schema() -> None:
    good = {"error": "x"}
    _validate(good, api_models.ErrorBody)
    with pytest.raises(jsonschema.ValidationError):
        _validate({"error": "x", "extra": 1}, api_models.ErrorBody)


def test_every_operation_documents_aiohttp_s_own_400_and_its_credentials() -> None:
    """A request the HTTP layer cannot parse gets aiohttp's text 400 on any path (found
    by schemathesis: a generated Transfer-Encoding header); a protected operation names
    its security and its 401 carries the challenge header."""
    for path, item in document()["paths"].items():
        for method, op in item.items():
            where = f"{method.upper()} {path}"
            assert "text/plain" in op["responses"]["400"]["content"], where
            if path.startswith(("/api/", "/proxy/", "/ui")):
                assert op["security"] == [{"bearer": []}, {"basic": []}], where
                assert "WWW-Authenticate" in op["responses"]["401"]["headers"], where
            elif path in ("/metrics", "/v1/collect"):
                assert {} in op["security"], where  # open unless http.protect_metrics
            else:
                assert "security" not in op and "401" not in op["responses"], where
