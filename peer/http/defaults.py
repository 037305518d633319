"""The gateway's defaults, in a module that imports nothing: `tessera serve --help` shows them
without importing torch (peer/cli/options.py), and `Gateway` (api.py) and `Exchange`
(exchange.py) take them from here."""

DEFAULT_MAX_TOKENS = 512  # when a request gives no max_tokens (clamped to the context)
# How long a request waits for the swarm to cover every layer before it gets a 503.
DEFAULT_ROUTE_WAIT = 10.0
DEFAULT_MAX_CONCURRENT = 8  # a cap on top of what the swarm holds (peer/http/capacity.py)
# How long a request whose session cannot be opened on a covered swarm (busy peers) keeps
# trying before a 503: a minute of queueing is what an API client's default timeout allows.
DEFAULT_QUEUE_WAIT = 60.0
# Seconds a client has to send its whole request body. A 4 MiB body crosses even a slow
# uplink (1 Mbit/s) in ~35 s; a chat request of a few KiB takes milliseconds. A client that
# announces a body and sends it slower than that (or not at all) holds a connection and a
# buffer for nothing: it gets a 408.
BODY_TIMEOUT = 30.0
