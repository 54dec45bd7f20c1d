"""Who may use the gateway's HTTP endpoints: bearer tokens, basic-auth users, and (for the
forward proxy and the operator page) a token as the Basic password. Every refusal is a
401/403 with a one-line JSON body, counted by reason
(``gpurelay_gateway_http_auth_failures_total{reason}``)."""

from __future__ import annotations

import hmac
import logging
from typing import Final

from aiohttp import web
from multidict import CIMultiDict

from cloud_gateway.http.models import ErrorBody
from cloud_gateway.http.state import STATE, error_response, route_template
from gpurelay.logs import Throttled
from gpurelay.web_config import BASIC_CHALLENGE, parse_basic

# Values of gpurelay_gateway_http_auth_failures_total{reason}.
AUTH_FAILURE_REASONS: Final = ("missing", "bad_token", "bad_password", "malformed")
BEARER_CHALLENGE: Final = 'Bearer realm="cloud-gateway"'
_log_refused = Throttled(logging.getLogger("cloud_gateway.http"), logging.WARNING)


def _refused(
    request: web.Request, reason: str, status: int, message: str, *challenges: str
) -> web.Response:
    """Counts the refusal (``reason`` from AUTH_FAILURE_REASONS) and builds the answer."""
    request.app[STATE].auth_failures[reason] += 1
    headers = CIMultiDict(("WWW-Authenticate", c) for c in challenges)
    body: ErrorBody = {"error": message}
    return web.json_response(body, status=status, headers=headers)


def _credentials(request: web.Request, *, proxy: bool) -> tuple[str, str]:
    """``(scheme, value)`` of the first Authorization (or, for a forward proxy, first
    Proxy-Authorization) header with a value; ``("", "")`` when there is none."""
    headers = ("Proxy-Authorization", "Authorization") if proxy else ("Authorization",)
    for header in headers:
        scheme, _, value = request.headers.get(header, "").partition(" ")
        if value.strip():
            return scheme.lower(), value.strip()
    return "", ""


def _token_ok(given: str, tokens: frozenset[str]) -> bool:
    data = given.encode()
    return any(hmac.compare_digest(data, t.encode()) for t in tokens)


async def authorised(
    request: web.Request,
    tokens: frozenset[str],
    *,
    what: str = "the operator API",
    proxy: bool = False,
    setting: str = "http.tokens or http.token_files",
    token_as_password: bool | None = None,
) -> web.Response | None:
    """None when the request may pass, else the 401/403 response to send. A bearer token
    from ``tokens``, a basic user, or (forward proxy and /ui: ``token_as_password``) a
    token as Basic password."""
    if token_as_password is None:
        token_as_password = proxy
    basic = request.app[STATE].basic_auth
    if not tokens and not basic:
        return error_response(
            403,
            f"{what} is closed: no tokens are configured on the gateway (set {setting}, "
            "or basic_auth_users in http.web_config_file)",
        )
    scheme, value = _credentials(request, proxy=proxy)
    if scheme == "bearer":
        if _token_ok(value, tokens):
            return None
        return _refused(request, "bad_token", 403, "the bearer token was not accepted")
    if scheme == "basic":
        pair = parse_basic(value)
        if pair is None:
            return _refused(
                request, "malformed", 401, "malformed basic credentials", BASIC_CHALLENGE
            )
        user, password = pair
        if token_as_password and _token_ok(password, tokens):
            return None
        if basic and await basic.verify(user, password, source=request.remote or None):
            return None
        _log_refused(
            "HTTP %s %s refused: wrong password for basic user %r from %r",
            request.method,
            route_template(request),
            user[:64],
            request.remote,
        )
        return _refused(
            request, "bad_password", 401, "wrong user name or password", BASIC_CHALLENGE
        )
    if basic:
        return _refused(
            request,
            "missing",
            401,
            "missing credentials: send 'Authorization: Bearer <token>' or basic auth",
            BEARER_CHALLENGE,
            BASIC_CHALLENGE,
        )
    return _refused(
        request,
        "missing",
        401,
        "missing bearer token: send 'Authorization: Bearer <token>'",
        BEARER_CHALLENGE,
    )


async def page_authorised(request: web.Request, tokens: frozenset[str]) -> web.Response | None:
    """The operator page: the API's credentials, and an API token as the Basic password
    (any user name), so that a browser's login prompt works with tokens only. A 401
    always asks for Basic: a browser prompts for nothing else."""
    refusal = await authorised(request, tokens, what="the operator page", token_as_password=True)
    if refusal is not None and refusal.status == 401:
        challenges = refusal.headers.getall("WWW-Authenticate", [])
        if BASIC_CHALLENGE not in challenges:
            refusal.headers.add("WWW-Authenticate", BASIC_CHALLENGE)
    return refusal
