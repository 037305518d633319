"""The gateway's defaults, in a module that imports nothing heavy: `tessera serve --help` shows
them without importing torch (peer/cli/options.py), and `Gateway` (api.py) and `Exchange`
(exchange.py) take them from here."""

from tessera.peer.base.backoff import ROUTE_WAIT

DEFAULT_MAX_TOKENS = 512  # when a request gives no max_tokens (clamped to the context)
# How long a request waits for the swarm to cover every layer before it gets a 503 (or, mid-way,
# a 502): the command line's wait, one constant (peer/base/backoff.py says why 30 s). 10 s here
# once turned a sole peer's restart (7-10 s to serve again) into a 502 that `tessera generate`
# rode out.
DEFAULT_ROUTE_WAIT = ROUTE_WAIT
DEFAULT_MAX_CONCURRENT = 8  # a cap on top of what the swarm holds (peer/http/capacity.py)
# How long a request whose session cannot be opened on a covered swarm (busy peers) keeps
# trying before a 503: a minute of queueing is what an API client's default timeout allows.
DEFAULT_QUEUE_WAIT = 60.0
# Seconds a client has to send its whole request body. A 4 MiB body crosses even a slow
# uplink (1 Mbit/s) in ~35 s; a chat request of a few KiB takes milliseconds. A client that
# announces a body and sends it slower than that (or not at all) holds a connection and a
# buffer for nothing: it gets a 408.
BODY_TIMEOUT = 30.0
