"""/admin/reload and /admin/status, and who may call them.

With a token (``--admin-token`` / $PRECAST_ADMIN_TOKEN) every admin request must carry it
(``Authorization: Bearer <token>`` or ``X-Admin-Token``), compared in constant time. Without one, admin
is open only on a loopback bind, and only to requests that are provably direct and local:

    the socket peer (not a header) is a loopback address     else 403: another host
    no Forwarded / X-Forwarded-* / X-Real-IP / Via header    else 403: relayed by a proxy in front
    Host is a loopback name (localhost, 127.x, [::1])        else 403: DNS rebinding or a proxy
    no foreign Origin, Sec-Fetch-Site same-origin or none    else 403: a web page in a local browser
    a body is sent as application/json                       else 415: what a cross-site form can send

A proxy that strips every forwarding header and rewrites Host to 127.0.0.1 cannot be told from a local
process: behind any proxy, set a token (README, "Serving").
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import re

from fastapi import APIRouter, Request

from precast.runtime.server.bodies import parse_json
from precast.runtime.server.config import is_loopback
from precast.runtime.server.host import ReloadBusyError, ReloadError, ReloadKindError
from precast.runtime.server.http_errors import HTTPError

__all__ = ["add_admin_routes", "check_admin", "router"]

router = APIRouter()

# Headers a reverse proxy (or a CDN) adds when it relays a request.
FORWARDING_HEADERS = (
    "forwarded",
    "x-forwarded-for",
    "x-forwarded-host",
    "x-forwarded-proto",
    "x-forwarded-port",
    "x-forwarded-server",
    "x-forwarded-prefix",
    "x-original-forwarded-for",
    "x-real-ip",
    "x-client-ip",
    "true-client-ip",
    "cf-connecting-ip",
    "via",
)
_LOCAL_FETCH_SITES = ("same-origin", "none")  # "none": typed into the address bar, not sent by a page


def check_admin(request: Request, config) -> None:
    """Returns if this request may use the admin endpoints, else raises the 401/403 saying why."""
    token = config.admin_token
    if token is not None:
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-admin-token", "")
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise HTTPError(401, "admin token missing or wrong (Authorization: Bearer <token>)")
        return
    if not is_loopback(config.host):
        raise HTTPError(
            403,
            "admin endpoints are disabled on a non-loopback bind without a token: "
            "start with --admin-token or PRECAST_ADMIN_TOKEN",
        )
    reason = _not_direct_and_local(request)
    if reason is not None:
        raise HTTPError(
            403,
            f"admin request refused: {reason}; without --admin-token admin endpoints answer only "
            "direct requests from this host",
        )


def _not_direct_and_local(request: Request) -> str | None:
    peer = request.client.host if request.client is not None else None
    if peer is None or not _loopback_address(peer):
        return f"it comes from {peer or 'an unknown peer'}, not from this host"
    headers = request.headers
    for name in FORWARDING_HEADERS:
        if name in headers:
            return f"it carries a {name} header (relayed by a proxy)"
    host = headers.get("host")
    if host is not None and not _loopback_name(_host_part(host)):
        return f"its Host header {host!r} is not this host"
    origin = headers.get("origin")
    if origin is not None and (host is None or origin.lower() not in (f"http://{host}", f"https://{host}")):
        return f"it was sent by the web page {origin!r} (cross-origin)"
    site = headers.get("sec-fetch-site")
    if site is not None and site not in _LOCAL_FETCH_SITES:
        return f"the browser marks it Sec-Fetch-Site: {site}"
    return None


def _loopback_address(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 on a dual-stack socket
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def _loopback_name(host: str) -> bool:
    return host.lower() == "localhost" or _loopback_address(host)


_HOST = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9.-]+))(?::[0-9]{1,5})?$")


def _host_part(host: str) -> str:
    """'127.0.0.1:8000' -> '127.0.0.1', '[::1]:8000' -> '::1'; '' for anything that is not exactly a host and
    an optional port ('127.0.0.1:80@evil.com', '[::1]evil.com'), so it cannot pass as loopback."""
    m = _HOST.match(host)
    return "" if m is None else (m["v6"] or m["name"])


def _check_json_content_type(request: Request, raw: bytes) -> None:
    """A body must be declared JSON: a browser sends that cross-site only after a CORS preflight, which
    this server never approves (text/plain and form posts need none)."""
    ctype = request.headers.get("content-type")
    media = ctype.split(";", 1)[0].strip().lower() if ctype is not None else None
    if (raw.strip() or media is not None) and media != "application/json":
        raise HTTPError(
            415,
            f"admin request body must be sent as application/json, got {ctype or 'no Content-Type'} "
            "(add -H 'Content-Type: application/json')",
        )


def _reload_path(request: Request, raw: bytes) -> str | None:
    """The artifact a reload body names (None: the same path again); a malformed body is a 400 (InputError)."""
    _check_json_content_type(request, raw)
    if not raw.strip():
        return None
    body = parse_json(raw)
    if not isinstance(body, dict) or not isinstance(body.get("path", ""), str):
        raise HTTPError(400, 'reload body must be {"path": "<artifact dir>"} or empty')
    return body.get("path") or None


@router.post("/admin/reload")
async def admin_reload(request: Request):
    state = request.app.state.precast
    check_admin(request, state.config)
    path = _reload_path(request, await request.body())
    try:
        served = await asyncio.to_thread(state.reload, path)
    except (ReloadBusyError, ReloadKindError) as e:
        raise HTTPError(409, str(e)) from None
    except ReloadError as e:
        raise HTTPError(422, str(e)) from None
    return {
        "ok": True,
        "model": state.name,
        "version": served.version,
        "path": str(served.path),
        "seconds": state.host.last_reload.get("seconds"),
    }


@router.get("/admin/status")
async def admin_status(request: Request):
    state = request.app.state.precast
    check_admin(request, state.config)
    served = state.host.current
    return {
        "model": state.name,
        "version": served.version,
        "kind": served.kind,
        "path": str(served.path),
        "digest": served.digest,
        "target": served.model.target,
        "last_reload": state.host.last_reload,
        "queue_depth": state.batcher.depth,
        "batches": state.batcher.batches,
    }


def add_admin_routes(app, state=None) -> None:
    app.include_router(router)
