"""Schemathesis against a live gateway: a real gateway process with the operator token and
a real agent connected (two simulated GPUs, its own HTTP port published), the document
loaded from the gateway's own ``/openapi.json``, every documented operation called with
generated input (valid and invalid), each answer checked against the document: no 5xx,
a documented status, the documented content type, a body matching its schema, the
documented headers (WWW-Authenticate on a 401), a refusal without credentials.

Generated names rarely hit the one real node, so the node's own pages (its detail, its
page, the proxy to its agent) are also called once with its name.

What is left out, and why: the proxy answers with the node's status, content type and
body (the agent's ``/metrics``, its 404 page...), which the gateway's document cannot
describe, so its content-type and body checks are off for ``/proxy/...`` (the gateway's
own refusals there are still checked for status and for no 5xx other than the documented
502/503/504 of an unreachable port). And on ``/metrics``, positive_data_acceptance: shard
and shards go together (shard < shards), which OpenAPI cannot express, so schema-valid
values of one alone are rightly a 400."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
import schemathesis.engine
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import Status, events
from schemathesis.engine.recorder import CheckNode
from schemathesis.schemas import BaseSchema

from harness.fleet import TOKEN, make_pki
from harness.services import AgentProc, GatewayProc
from harness.waiting import wait_until

NODE = "edge-api"
EXAMPLES = 100  # at most per operation and phase: about 2,000 requests, some seconds
PROXY = "/proxy/{node}/{port}/{path}"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayProc, AgentProc]]:
    tmp: Path = tmp_path_factory.mktemp("schemathesis")
    pki = make_pki(tmp)
    gateway = GatewayProc(pki, tmp)
    agent = AgentProc(pki, tmp, NODE, gateway, spool_dir=tmp / "spool")
    try:
        gateway.start()
        wait_until(gateway.ready, 60, "gateway ready")
        agent.start()
        auth = {"Authorization": f"Bearer {TOKEN}"}

        def published() -> bool:
            groups = httpx.get(f"{gateway.url}/api/v1/sd", headers=auth, timeout=5).json()
            return any(g["labels"]["node"] == NODE for g in groups)

        wait_until(published, 60, "the agent's endpoint in /api/v1/sd")
        yield gateway, agent
    finally:
        agent.stop()
        gateway.stop()


def _config(base_url: str) -> SchemathesisConfig:
    return SchemathesisConfig.from_dict(
        {
            "base-url": base_url,
            "seed": 17,
            "generation": {"max-examples": EXAMPLES, "mode": "all", "database": "none"},
            "phases": {
                "stateful": {"enabled": False},  # no links: nothing to chain
                # schema order: "auto" orders by inferred resource dependencies, and its
                # layers leave out GET /openapi.json
                **{p: {"operation-ordering": "none"} for p in ("examples", "coverage", "fuzzing")},
            },
            "auth": {"openapi": {"bearer": {"bearer": TOKEN}}},
            "request-timeout": 15,
            "operations": [
                {
                    "include-path": PROXY,
                    "checks": {
                        "content_type_conformance": {"enabled": False},
                        "response_schema_conformance": {"enabled": False},
                    },
                },
                {
                    # shard and shards go together (shard < shards): OpenAPI cannot say
                    # that one parameter needs the other, so schema-valid pairs get a 400
                    "include-path": "/metrics",
                    "checks": {"positive_data_acceptance": {"enabled": False}},
                },
            ],
        }
    )


@pytest.fixture(scope="module")
def api(live: tuple[GatewayProc, AgentProc]) -> BaseSchema:
    gateway, _agent = live
    # The gateway's own document, as served; not from_url, which leaves the operation
    # at the document's own URL (GET /openapi.json) out of the run.
    served = httpx.get(f"{gateway.url}/openapi.json", timeout=10).json()
    return schemathesis.openapi.from_dict(served, config=_config(gateway.url))


def _failure(event: events.ScenarioFinished, case_id: str, check: CheckNode) -> str:
    case = event.recorder.cases[case_id].value
    info = check.failure_info
    title = info.failure.title if info is not None else check.name
    message = " ".join(str(info.failure.message).split())[:300] if info is not None else ""
    request = f"{case.method} {case.formatted_path} query={case.query} headers={case.headers}"
    return f"{event.label} [{event.phase.value}] {check.name}: {title}: {message}\n  {request}"


def test_every_operation_answers_as_documented(api: BaseSchema) -> None:
    """The run schemathesis' CLI makes (examples, coverage with invalid values, fuzzing),
    through its engine: the pytest loader of a schema from a fixture does not work with
    pytest 9.2 (it sets ``request.node._nodeid``, which pytest no longer has)."""
    failures: set[str] = set()
    errors: list[str] = []
    cases: Counter[str] = Counter()
    skipped: dict[str, str] = {}
    for event in schemathesis.engine.from_schema(api).execute():
        if isinstance(event, events.ScenarioFinished) and event.label:
            cases[event.label] += len(event.recorder.cases)
            if event.status == Status.SKIP:
                skipped[event.label] = str(event.skip_reason)
            for case_id, checks in event.recorder.checks.items():
                for check in checks:
                    if check.status == Status.FAILURE:
                        failures.add(_failure(event, case_id, check))
        elif isinstance(event, events.NonFatalError):
            errors.append(f"{event.label}: {event.info.format()}")
        elif isinstance(event, events.FatalError):
            errors.append(repr(event.exception))
    assert not errors, "\n".join(errors)
    assert not failures, "\n".join(sorted(failures))
    operations = {f"{m.upper()} {p}" for p, item in api.raw_schema["paths"].items() for m in item}
    assert set(cases) == operations, f"operations schemathesis did not call: {skipped}"
    # an operation without parameters has few distinct requests to make
    assert all(n >= 5 for n in cases.values()), cases
    assert cases.total() > 10 * EXAMPLES, cases


@pytest.mark.parametrize(
    ("path", "method", "parameters"),
    [
        ("/api/v1/nodes/{node}", "GET", {"node": NODE}),
        ("/ui/nodes/{node}", "GET", {"node": NODE}),
        (PROXY, "GET", {"node": NODE, "path": "metrics"}),
    ],
)
def test_the_real_node_s_pages_answer_as_documented(
    api: BaseSchema,
    live: tuple[GatewayProc, AgentProc],
    path: str,
    method: str,
    parameters: dict[str, object],
) -> None:
    _gateway, agent = live
    if "port" in path:
        parameters = {**parameters, "port": agent.port}
    case = api[path][method].Case(path_parameters=parameters)
    response = case.call_and_validate(headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200, response.text[:300]
    if path == "/api/v1/nodes/{node}":
        detail = response.json()
        assert detail["name"] == NODE and len(detail["gpus"]) == 2
        assert detail["published"] and "recent_errors" in detail
