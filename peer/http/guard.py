"""Only this machine's own pages drive the gateway and the web view: the Host and Origin checks.

A gateway (`tessera serve`) or a peer's web view (`tessera peer --web`) listens on loopback,
and every page open in the volunteer's browser can send requests there. Two attacks follow,
and both were shown against this server:

- **Cross-site requests.** A page of any site POSTs to `http://127.0.0.1:8080/web/api/peer/pause`
  (the peer stops serving) or sends a `text/plain` chat completion to the gateway (it runs on
  the swarm). The browser refuses the page the *answer*, but the request has been served.
  A body of `text/plain`, a form's types or none at all is a "simple" request: the browser
  sends it without asking the server first.
- **DNS rebinding.** A site's name is made to resolve to 127.0.0.1 after its page loaded; the
  page's requests to its own origin then reach this server, same-origin for the browser, so
  the page reads the answers too. The one thing that gives it away is the `Host` header: the
  attacker's name, not an address of this machine.

So `OriginGuard`, in front of the whole app (pages, web API and gateway), checks every request:

1. **Host** must be a name this server answers for: an IP address (a browser sends one only
   for a page loaded from that very address, which no DNS answer can fake), `localhost` or a
   name under `.localhost` (browsers resolve those to loopback themselves, never through DNS),
   or the host of an origin given with `--allow-origin` (a reverse proxy's name, a LAN name).
   Anything else is a 403 `host_not_allowed` — before anything is read or answered. A request
   without Host (HTTP/1.0, some test clients) cannot come from a browser and passes.
2. A request that can change state — any method but GET, HEAD and OPTIONS — must come from
   no browser page at all (no `Origin`: curl, the OpenAI and Anthropic SDKs) or from this
   server's own pages (`Origin` is scheme://Host of the request), from an `--allow-origin`,
   or from a `--cors-origin` (pages the operator let call the API; `*`: any). Else a 403
   `origin_not_allowed`. Browsers send `Origin` on every such request, same-origin included.
3. Such a request must say `Content-Type: application/json`: a page of another site cannot
   send that type without a CORS preflight, which only `--cors-origin` pages pass. Else a 415
   (an older browser that sends no `Origin` still cannot forge the type).

GET requests change nothing here (reading is what the Host check protects, and the browser
withholds a cross-origin answer without CORS headers), so they are not asked for an Origin.
CORS itself — which foreign pages may *read* answers — stays the gateway's (`Gateway.cors`,
docs/pages/http.md); this module only refuses. `--allow-origin` is how a gateway is exposed
on purpose (docs/pages/web.md).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable
from urllib.parse import urlsplit

from tessera.peer.http import anthropic as http_anthropic
from tessera.peer.http.exchange import Exchange, Receive, Send
from tessera.peer.http.requests import ApiError

Asgi = Callable[[dict, Receive, Send], Awaitable[None]]

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})  # change nothing; no Origin or body type asked
JSON_TYPE = "application/json"
DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class Origin:
    """A browser origin: scheme, host (lower case, IPv6 without brackets) and port (explicit or the scheme's)."""

    scheme: str
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = DEFAULT_PORTS.get(self.scheme)
        return f"{self.scheme}://{host}" + ("" if self.port == default else f":{self.port}")


def parse_origin(text: str) -> Origin:
    """An origin as a browser writes it (`https://llm.example.org`, `http://10.0.0.5:8000`).
    Raises ValueError naming what is wrong (a path, no host, another scheme, `null`)."""
    try:
        parts = urlsplit(text.strip())
        port = parts.port
    except ValueError as bad:
        raise ValueError(f"{text!r} is not an origin: {bad}") from None
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname:
        raise ValueError(f"{text!r} is not an origin: it must be http:// or https:// and a host, as "
                         f"'https://llm.example.org' or 'http://10.0.0.5:8000'")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"{text!r} is not an origin: an origin is scheme://host[:port], nothing after it")
    return Origin(parts.scheme, parts.hostname.lower(), port or DEFAULT_PORTS[parts.scheme])


def parse_host(value: str) -> tuple[str, int | None]:
    """(host in lower case, port or None) of a Host header. Raises ValueError."""
    parts = urlsplit("//" + value.strip())
    if not parts.hostname or parts.path or parts.query or parts.fragment or parts.username is not None:
        raise ValueError(f"bad Host header {value!r}")
    return parts.hostname.lower(), parts.port


def is_address_or_localhost(host: str) -> bool:
    """An IP address, `localhost` or a name under `.localhost` (module docstring, rule 1)."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(host.split("%", 1)[0])  # an IPv6 zone (fe80::1%eth0) is an address too
    except ValueError:
        return False
    return True


class HostRules:
    """What the guard accepts (module docstring): the hosts of `allow_origins`, and which
    origins' pages may change state (`allow_origins`, `cors_origins`; "*" in the latter: any)."""

    def __init__(self, allow_origins: Iterable[str] = (), cors_origins: Iterable[str] = ()) -> None:
        self.allowed = frozenset(parse_origin(o) for o in allow_origins)  # raises ValueError
        cors = set(cors_origins)
        self.any_origin = "*" in cors
        self.cors = frozenset(str(parse_origin(o)) for o in cors - {"*"})
        self.hosts = frozenset(o.host for o in self.allowed)

    def refusal(self, method: str, scheme: str, headers: dict[str, str], path: str) -> ApiError | None:
        """Why this request is refused (an ApiError to answer with), or None: it may go on.
        `headers`: lower-case names to values (a pure function: unit- and property-tested)."""
        host_header = headers.get("host")
        own: Origin | None = None
        if host_header is not None:
            try:
                host, port = parse_host(host_header)
            except ValueError:
                return ApiError(400, f"the Host header {host_header!r} is not a host[:port]", code="bad_host")
            if not (is_address_or_localhost(host) or host in self.hosts):
                return ApiError(403, f"this server does not answer for the host {host!r}: a name that is not "
                                     f"an address of this machine (a page of another site can point its own "
                                     f"name here). To serve this name on purpose, start it with "
                                     f"--allow-origin {scheme}://{host_header.strip()}",
                                type="permission_error", code="host_not_allowed")
            own = Origin(scheme, host, port or DEFAULT_PORTS.get(scheme, 0))
        if method.upper() in SAFE_METHODS:
            return None
        origin = headers.get("origin")
        if origin is not None and not self.origin_may_act(origin, own):
            return ApiError(403, f"pages of {origin!r} may not {method} here: only this server's own pages, "
                                 f"and origins given with --allow-origin or --cors-origin, may change anything",
                            type="permission_error", code="origin_not_allowed")
        media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media != JSON_TYPE:
            return ApiError(415, f"{method} {path} takes a JSON body: send 'Content-Type: {JSON_TYPE}'"
                                 f" (got {media or 'none'!r})", code="unsupported_media_type")
        return None

    def origin_may_act(self, origin: str, own: Origin | None) -> bool:
        if self.any_origin:
            return True
        try:
            parsed = parse_origin(origin)  # "null" (a sandboxed frame, a file://) is no origin: refused
        except ValueError:
            return False
        return parsed == own or parsed in self.allowed or str(parsed) in self.cors


class OriginGuard:
    """ASGI middleware: `app` behind the checks of `rules` (module docstring)."""

    def __init__(self, app: Asgi, rules: HostRules) -> None:
        self.app = app
        self.rules = rules

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            error = self.rules.refusal(scope["method"], scope.get("scheme", "http"), headers, scope["path"])
            if error is not None:
                anthropic = scope["path"].rstrip("/") == "/v1/messages"
                body = http_anthropic.error_body(error) if anthropic else error.body()
                await Exchange(scope, receive, send).json(error.status, body, error.headers)
                return
        await self.app(scope, receive, send)


__all__ = ["OriginGuard", "HostRules", "Origin", "parse_origin", "parse_host"]
