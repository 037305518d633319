"""The Host and Origin rules of peer/http/guard.py, as a pure function (no server).

What a request may do is decided from its method, scheme and headers alone, so the rules
are checked here on every combination that matters and on random ones (hypothesis); the
same guard in front of a real peer's web view and a real gateway, over HTTP, is in
tests/web/test_web_guard.py and tests/http/test_http.py, and in chromium in
tests/web/test_web_browser.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.peer.http.guard import HostRules, parse_origin

JSON = {"content-type": "application/json"}


def refused(rules: HostRules, method: str, **headers: str) -> str | None:
    """The refusal's code (None: allowed); header names with '_' for '-'."""
    error = rules.refusal(method, "http", {k.replace("_", "-"): v for k, v in headers.items()}, "/x")
    return None if error is None else (error.code or str(error.status))


def test_a_page_of_another_site_cannot_change_anything():
    rules = HostRules()
    # the attack that paused a peer: a simple (text/plain) cross-site POST
    assert refused(rules, "POST", host="127.0.0.1:8080", origin="http://evil.example",
                   content_type="text/plain") == "origin_not_allowed"
    # another page on this very machine (another port is another origin)
    assert refused(rules, "POST", host="127.0.0.1:8080", origin="http://127.0.0.1:3000", **JSON) == "origin_not_allowed"
    assert refused(rules, "POST", host="127.0.0.1:8080", origin="null", **JSON) == "origin_not_allowed"
    # an older browser that sends no Origin still cannot forge the JSON type
    assert refused(rules, "POST", host="127.0.0.1:8080", content_type="text/plain") == "unsupported_media_type"
    assert refused(rules, "POST", host="127.0.0.1:8080") == "unsupported_media_type"
    assert refused(rules, "DELETE", host="127.0.0.1:8080", origin="http://evil.example", **JSON) == "origin_not_allowed"


def test_this_servers_own_pages_and_clients_without_a_browser_may():
    rules = HostRules()
    assert refused(rules, "POST", host="127.0.0.1:8080", origin="http://127.0.0.1:8080", **JSON) is None
    assert refused(rules, "POST", host="localhost:8080", origin="http://localhost:8080",
                   content_type="application/json; charset=utf-8") is None
    assert refused(rules, "POST", host="[::1]:8080", origin="http://[::1]:8080", **JSON) is None
    assert refused(rules, "POST", host="127.0.0.1", origin="http://127.0.0.1", **JSON) is None  # port 80 both
    assert refused(rules, "POST", host="127.0.0.1:8080", **JSON) is None  # curl, the SDKs: no Origin
    assert refused(rules, "POST", **JSON) is None  # no Host at all: no browser
    # reading changes nothing: no Origin or type asked of a GET (the browser withholds the answer)
    assert refused(rules, "GET", host="127.0.0.1:8080", origin="http://evil.example") is None
    assert refused(rules, "OPTIONS", host="127.0.0.1:8080", origin="http://evil.example") is None


def test_a_name_that_is_not_an_address_is_refused_whatever_the_method():
    """DNS rebinding: the attacker's name resolves here; its Host header gives it away."""
    rules = HostRules()
    for method in ("GET", "HEAD", "POST", "OPTIONS"):
        assert refused(rules, method, host="rebind.example:8080") == "host_not_allowed"
        assert refused(rules, method, host="rebind.example:8080", origin="http://rebind.example:8080",
                       **JSON) == "host_not_allowed"
    for host in ("10.1.2.3:8000", "192.168.0.5", "[fe80::1]:8000", "localhost", "app.localhost:9",
                 "LOCALHOST:8000"):
        assert refused(rules, "GET", host=host) is None, host
    assert refused(rules, "GET", host="localhost.evil.example") == "host_not_allowed"
    assert refused(rules, "GET", host="127.0.0.1.nip.io:8080") == "host_not_allowed"
    assert refused(rules, "GET", host="bad host:x") == "bad_host"
    message = rules.refusal("GET", "http", {"host": "rebind.example:8080"}, "/").message
    assert "--allow-origin http://rebind.example:8080" in message and "\n" not in message


def test_allow_origin_exposes_a_name_on_purpose():
    rules = HostRules(["https://llm.example.org", "http://tessera.lan:8000"])
    assert refused(rules, "GET", host="llm.example.org") is None
    assert refused(rules, "GET", host="tessera.lan:8000") is None
    # behind a TLS proxy: the page is https://llm.example.org, the request arrives as http
    assert refused(rules, "POST", host="llm.example.org", origin="https://llm.example.org", **JSON) is None
    assert refused(rules, "POST", host="127.0.0.1:8000", origin="https://llm.example.org", **JSON) is None
    assert refused(rules, "POST", host="llm.example.org", origin="https://evil.example", **JSON) == "origin_not_allowed"
    assert refused(rules, "GET", host="other.example.org") == "host_not_allowed"
    assert refused(rules, "POST", host="llm.example.org", origin="https://llm.example.org",
                   content_type="text/plain") == "unsupported_media_type"


def test_cors_origins_may_act_and_star_lets_any():
    rules = HostRules(cors_origins=["https://app.example"])
    assert refused(rules, "POST", host="127.0.0.1:8000", origin="https://app.example", **JSON) is None
    assert refused(rules, "POST", host="127.0.0.1:8000", origin="https://app.example:443", **JSON) is None
    assert refused(rules, "POST", host="127.0.0.1:8000", origin="https://other.example", **JSON) == "origin_not_allowed"
    anyone = HostRules(cors_origins=["*"])
    assert refused(anyone, "POST", host="127.0.0.1:8000", origin="https://other.example", **JSON) is None
    assert refused(anyone, "GET", host="rebind.example") == "host_not_allowed"  # CORS is no Host rule
    assert refused(anyone, "POST", host="127.0.0.1:8000", origin="https://other.example",
                   content_type="text/plain") == "unsupported_media_type"


@pytest.mark.parametrize("text", ["*", "null", "llm.example.org", "ftp://x.example", "https://x.example/path",
                                  "https://x.example?q=1", "http://", "http://x.example:99999", "https://u@x.example"])
def test_a_bad_origin_is_refused_naming_it(text):
    with pytest.raises(ValueError, match="origin"):
        parse_origin(text)
    with pytest.raises(ValueError):
        HostRules([text])


def test_origins_compare_as_browsers_write_them():
    assert parse_origin("HTTPS://LLM.Example.org:443") == parse_origin("https://llm.example.org")
    assert str(parse_origin("http://[::1]:8000")) == "http://[::1]:8000"
    assert parse_origin("http://x.example:8080") != parse_origin("http://x.example")


names = st.from_regex(r"[a-z][a-z0-9-]{0,10}(\.[a-z][a-z0-9-]{0,10}){1,2}", fullmatch=True)
ports = st.one_of(st.none(), st.integers(1, 65535))
methods = st.sampled_from(["GET", "HEAD", "OPTIONS", "POST", "PUT", "PATCH", "DELETE"])
types = st.sampled_from([None, "application/json", "text/plain", "application/x-www-form-urlencoded",
                         "multipart/form-data; boundary=x", "application/json; charset=utf-8"])


def host_of(name: str, port: int | None) -> str:
    return name if port is None else f"{name}:{port}"


@settings(max_examples=400, deadline=None)
@given(names, ports, names, ports, methods, types, st.booleans())
def test_a_foreign_page_never_changes_state_and_a_rebound_name_is_never_answered(
        name, port, page, page_port, method, content_type, same):
    """For random hosts and origins: a DNS name not allowed is refused whatever else; on an
    address, a state-changing request passes only from this server's own origin or no origin,
    and only with a JSON body."""
    rules = HostRules(["https://allowed.example.org"])
    headers = {"host": host_of(name, port)}
    if content_type:
        headers["content-type"] = content_type
    error = rules.refusal(method, "http", headers, "/x")
    if name != "allowed.example.org":
        assert error is not None and error.code == "host_not_allowed"
    address = {**headers, "host": host_of("127.0.0.1", port)}
    origin = f"http://127.0.0.1{'' if port is None else f':{port}'}" if same else f"http://{host_of(page, page_port)}"
    error = rules.refusal(method, "http", {**address, "origin": origin}, "/x")
    if method in ("GET", "HEAD", "OPTIONS"):
        assert error is None
    elif not same and page != "allowed.example.org":
        assert error is not None and error.status in (403, 415)
    elif (content_type or "").split(";")[0] != "application/json":
        assert error is not None and error.status == 415
    elif same:
        assert error is None
