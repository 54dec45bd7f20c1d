"""The OpenAPI 3.1 description served at ``/openapi.json``."""

from __future__ import annotations

from typing import Any

from cloud_gateway import __version__

_ERROR = {
    "description": "error",
    "content": {
        "application/json": {
            "schema": {"type": "object", "properties": {"error": {"type": "string"}}}
        }
    },
}
_AUTH = {"401": _ERROR, "403": _ERROR}
_NODE = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "state": {"type": "string", "enum": ["online", "stale", "offline"]},
        "domain": {"type": "string"},
        "gpu_count": {"type": "integer"},
        "gpu_models": {"type": "array", "items": {"type": "string"}},
        "agent_version": {"type": "string"},
        "backend": {"type": "string"},
        "remote": {"type": "string"},
        "connected_since": {"type": ["number", "null"]},
        "last_seen": {"type": ["number", "null"]},
        "last_seen_seconds_ago": {"type": ["number", "null"]},
        "last_batch_time": {"type": ["number", "null"]},
        "interval_seconds": {"type": "number"},
        "series": {"type": "integer"},
        "batches_received": {"type": "integer"},
        "bytes_received": {"type": "integer"},
        "duplicate_batches": {"type": "integer"},
        "replayed_batches": {"type": "integer"},
        "connection_conflicts": {"type": "integer"},
        "certificate_serial": {"type": ["integer", "null"]},
        "certificate_expires": {
            "type": ["integer", "null"],
            "description": "unix time the node's SSH certificate expires (valid_before); "
            "null: no expiry, or not known",
        },
        "gateway": {"type": "string", "description": "the owner's id (with [cluster])"},
    },
}
_JSON = {"content": {"application/json": {"schema": {"type": "object"}}}}
_SHARD = [
    {
        "name": name,
        "in": "query",
        "description": "only the nodes whose name hashes to shard (0..shards-1) of shards "
        "(1..1024); both or neither. The gateway's own gpurelay_gateway_* families are in "
        "shard 0; the shards together hold every series once",
        "schema": {"type": "integer", "minimum": low},
    }
    for name, low in (("shard", 0), ("shards", 1))
]
_TEXT = {"content": {"text/plain": {"schema": {"type": "string"}}}}

OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "edge-gpu-relay cloud gateway", "version": __version__},
    "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    "paths": {
        "/metrics": {
            "get": {
                "summary": "All nodes' latest series, node-stamped (text or OpenMetrics)",
                "parameters": _SHARD,
                "responses": {"200": {"description": "exposition", **_TEXT}, "400": _ERROR},
            }
        },
        "/v1/collect": {
            "get": {
                "summary": "Baidu BIE accelerator map: node -> GPU memory summary",
                "responses": {"200": {"description": "BIE document"}},
            }
        },
        "/api/v1/nodes": {
            "get": {
                "summary": "List nodes",
                "security": [{"bearer": []}],
                "parameters": [
                    {
                        "name": "state",
                        "in": "query",
                        "schema": {"type": "string", "enum": ["online", "stale", "offline"]},
                    },
                    {"name": "domain", "in": "query", "schema": {"type": "string"}},
                ],
                "responses": {
                    "200": {
                        "description": "nodes",
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "properties": {
                                        "now": {"type": "number"},
                                        "nodes": {"type": "array", "items": _NODE},
                                    },
                                }
                            }
                        },
                    },
                    "400": _ERROR,
                    **_AUTH,
                },
            }
        },
        "/api/v1/nodes/{node}": {
            "get": {
                "summary": "One node: details, GPUs, recent errors",
                "security": [{"bearer": []}],
                "parameters": [
                    {"name": "node", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "responses": {"200": {"description": "node"}, "404": _ERROR, **_AUTH},
            }
        },
        "/api/v1/gateways": {
            "get": {
                "summary": "The cluster's gateways: id, advertise, alive, this, "
                "heartbeat_age_seconds, up_seconds, nodes (one gateway: itself)",
                "security": [{"bearer": []}],
                "responses": {"200": {"description": "gateways", **_JSON}, **_AUTH},
            }
        },
        "/api/v1/sd": {
            "get": {
                "summary": "Prometheus http_sd: the nodes' published endpoints",
                "security": [{"bearer": []}],
                "responses": {"200": {"description": "target groups", **_JSON}, **_AUTH},
            }
        },
        "/api/v1/sd/metrics": {
            "get": {
                "summary": "Prometheus http_sd of the gateways' own /metrics: per live "
                "gateway, one target per shard (labels __param_shard, __param_shards, "
                "gateway, shard); shards=1 (default): one target per gateway, the whole body",
                "security": [{"bearer": []}],
                "parameters": [
                    {"name": "shards", "in": "query", "schema": {"type": "integer", "minimum": 1}}
                ],
                "responses": {
                    "200": {"description": "target groups", **_JSON},
                    "400": _ERROR,
                    **_AUTH,
                },
            }
        },
        "/healthz": {"get": {"summary": "Process is alive", "responses": {"200": _TEXT}}},
        "/health": {"get": {"summary": "Process is alive", "responses": {"200": _TEXT}}},
        "/readyz": {
            "get": {
                "summary": "Listeners are bound and the gateway is not shutting down",
                "responses": {"200": _TEXT, "503": _TEXT},
            }
        },
    },
}
