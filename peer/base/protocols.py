"""Every protocol id a peer speaks, and the waits that more than one layer shares.

In one place so that both ends of a protocol (a server in serve/, a requester in request/)
name it from here, not from each other.
"""

from __future__ import annotations

SESSION_PROTOCOL = "/tessera/session/1.0.0"  # requester <-> each peer of its route
LINK_PROTOCOL = "/tessera/link/1.0.0"  # peer i -> peer i+1 of a route
GOSSIP_PROTOCOL = "/tessera/gossip/1.0.0"  # advertisement exchange
PING_PROTOCOL = "/tessera/ping/1.0.0"  # RTT probes
SHARD_SESSION_PROTOCOL = "/tessera/shard-session/1.0.0"  # requester <-> each member of a group
SHARD_LINK_PROTOCOL = "/tessera/shard-link/1.0.0"  # member i -> member j of a group, per session
REPORT_PROTOCOL = "/tessera/reports/1.0.0"
LINKS_PROTOCOL = "/tessera/links/1.0.0"
DIALBACK_PROTOCOL = "/tessera/dialback/1.0.0"  # asker -> helper: please dial me back
DIALBACK_PROBE_PROTOCOL = "/tessera/dialback-probe/1.0.0"  # helper's fresh host -> asker: the dial-back
WEIGHTS_PROTOCOL = "/tessera/weights/1.0.0"  # fetcher -> holder: manifest and weight chunks (peer/weights/)
DEDICATED_PROTOCOL = "/tessera/dedicated/1.0.0"  # dialler -> peer: where it takes dedicated connections (peer/net/dedicated/)

# One collective waits for every other rank's contribution: one link RTT plus the time
# the slowest rank needs to compute up to that collective. On a decode step that is
# milliseconds; a long prefill on a slow CPU computes one operator of a few thousand
# tokens in seconds. 30 s bounds a hung rank without ever tripping on a live one.
COLLECTIVE_TIMEOUT = 30.0
