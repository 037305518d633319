"""`tessera revoke PEER_ID`: tell a running `tessera serve` to stop using a peer, now.

A thin client of the gateway's `POST /admin/revoke` (peer/http/api.py), which answers
only loopback clients: run it on the gateway's machine.
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request

from tessera.peer.base.errors import PeerError, UnknownPeer

# A revocation is one message to the revoked peer per running session (each bounded by
# route_session.CLOSE_TIMEOUT, 2 s) on a gateway that may be busy: a minute is ample.
REVOKE_TIMEOUT = 60.0


class GatewayError(PeerError):
    """The gateway refused the revocation or could not be reached."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "revoke",
        help="tell a running `tessera serve` to stop using a peer (from now on, and mid-answer)",
        epilog="examples:\n  tessera revoke 12D3KooWAbc...                       # the gateway on 127.0.0.1:8000\n"
        "  tessera revoke 12D3KooWAbc... --url http://127.0.0.1:9000",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("peer", metavar="PEER_ID", help="the full peer id to revoke")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway (default http://127.0.0.1:8000)")
    p.add_argument("--api-key", default=None, help="the gateway's API key, if it has one (default $TESSERA_API_KEY)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from tessera.peer.request.policy import check_peer_id

    peer = check_peer_id(args.peer, what="PEER_ID")  # a typo costs no request
    body = json.dumps({"peer": peer}).encode()
    request = urllib.request.Request(args.url.rstrip("/") + "/admin/revoke", data=body, method="POST",
                                     headers={"content-type": "application/json"})
    key = args.api_key or os.environ.get("TESSERA_API_KEY")
    if key:
        request.add_header("authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=REVOKE_TIMEOUT) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as error:
        try:
            message = json.loads(error.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = error.reason
        kind = UnknownPeer if error.code == 404 else GatewayError
        raise kind(f"the gateway at {args.url} answered {error.code}: {message}") from None
    except (urllib.error.URLError, OSError) as error:
        raise GatewayError(f"cannot reach the gateway at {args.url}: {error}") from None
    print(f"revoked {answer['revoked']}: removed from {answer['sessions']} running session(s); "
          f"{len(answer['deny'])} peer(s) denied in all")
    return 0
