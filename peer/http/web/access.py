"""Who may read the web view's data and who may act: the API's rules, for a peer's own web view.

In front of a gateway the web view asks the `Gateway` itself (`check_key`,
`check_admin`: one rule for the API and the pages). A peer's `--web` has no gateway;
`KeyAccess` applies the same rules there: with a key, every data call carries
``Authorization: Bearer KEY`` (or ``x-api-key``); admin calls (drain, pause, resume)
come only from this machine (a loopback client), with the key when there is one.
The pages themselves (HTML, CSS, scripts) hold no data and need no key.
"""

from __future__ import annotations

import hmac
import ipaddress
from typing import Protocol

from tessera.peer.http.exchange import Exchange
from tessera.peer.http.requests import ApiError


class Access(Protocol):
    """What the web view asks before answering (`Gateway` is one)."""

    api_key: str | None

    def check_key(self, http: Exchange) -> None: ...

    def check_admin(self, http: Exchange) -> None: ...


def is_loopback(http: Exchange) -> bool:
    """Whether the client is on this machine (a unix socket or an unparsable address is not)."""
    client = http.scope.get("client")
    try:
        return client is not None and ipaddress.ip_address(client[0]).is_loopback
    except ValueError:
        return False


class KeyAccess:
    """The API's key and loopback rules without a gateway (see the module docstring)."""

    def __init__(self, api_key: str | None) -> None:
        self.api_key = api_key or None

    def check_key(self, http: Exchange) -> None:
        if self.api_key is None:
            return
        expected = self.api_key.encode()
        given = http.header(b"x-api-key")
        if given is not None and hmac.compare_digest(given.strip().encode(), expected):
            return
        scheme, _, bearer = (http.header(b"authorization") or "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(bearer.strip().encode(), expected):
            return
        if given is None and not bearer.strip():
            raise ApiError(401, "missing API key: send the header 'Authorization: Bearer KEY'",
                           code="invalid_api_key")
        raise ApiError(401, "incorrect API key", code="invalid_api_key")

    def check_admin(self, http: Exchange) -> None:
        if not is_loopback(http):
            raise ApiError(403, "admin calls are answered only from this machine (a loopback client)",
                           type="permission_error", code="forbidden")
        self.check_key(http)
