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

from fastapi import Request

from precast.runtime.errors import InputError
from precast.runtime.server.bodies import parse_json, v2_error
from precast.runtime.server.config import is_loopback
from precast.runtime.server.host import ReloadBusyError, ReloadError, ReloadKindError

__all__ = ["add_admin_routes", "admin_denied"]

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


def admin_denied(request: Request, config):
    """None if this request may use the admin endpoints, else the 401/403 response saying why."""
    token = config.admin_token
    if token is not None:
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-admin-token", "")
        if not hmac.compare_digest(given.encode(), token.encode()):
            return v2_error(401, "admin token missing or wrong (Authorization: Bearer <token>)")
        return None
    if not is_loopback(config.host):
        return v2_error(
            403,
            "admin endpoints are disabled on a non-loopback bind without a token: "
            "start with --admin-token or PRECAST_ADMIN_TOKEN",
        )
    reason = _not_direct_and_local(request)
    if reason is not None:
        return v2_error(
            403,
            f"admin request refused: {reason}; without --admin-token admin endpoints answer only "
            "direct requests from this host",
        )
    return None


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


def _json_content_type_problem(request: Request, raw: bytes):
    """A body must be declared JSON: a browser sends that cross-site only after a CORS preflight, which
    this server never approves (text/plain and form posts need none)."""
    ctype = request.headers.get("content-type")
    media = ctype.split(";", 1)[0].strip().lower() if ctype is not None else None
    if (raw.strip() or media is not None) and media != "application/json":
        return v2_error(
            415,
            f"admin request body must be sent as application/json, got {ctype or 'no Content-Type'} "
            "(add -H 'Content-Type: application/json')",
        )
    return None


def add_admin_routes(app, state) -> None:
    @app.post("/admin/reload")
    async def admin_reload(request: Request):
        if (err := admin_denied(request, state.config)) is not None:
            return err
        raw = await request.body()
        if (err := _json_content_type_problem(request, raw)) is not None:
            return err
        path = None
        if raw.strip():
            try:
                body = parse_json(raw)
            except InputError as e:
                return v2_error(400, str(e))
            if not isinstance(body, dict) or not isinstance(body.get("path", ""), str):
                return v2_error(400, 'reload body must be {"path": "<artifact dir>"} or empty')
            path = body.get("path") or None
        try:
            served = await asyncio.to_thread(state.reload, path)
        except (ReloadBusyError, ReloadKindError) as e:
            return v2_error(409, str(e))
        except ReloadError as e:
            return v2_error(422, str(e))
        return {
            "ok": True,
            "model": state.name,
            "version": served.version,
            "path": str(served.path),
            "seconds": state.host.last_reload.get("seconds"),
        }

    @app.get("/admin/status")
    async def admin_status(request: Request):
        if (err := admin_denied(request, state.config)) is not None:
            return err
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
