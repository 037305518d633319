"""Dedicated connections: a session's or a link's stream on a TCP connection of its own.

`stream.py` is one such stream; `service.py` is a host's listener, dials and the policy
below.

Why. On py-libp2p 0.8.1 every frame of a stream crosses yamux in Python: a reader task
parses each header into a buffer and sets an event, and the stream's reader wakes after
it. That machinery costs more than the bytes. A 2.4 KB frame's round trip between two
processes (bench/streams.py, 2-core machine) takes 0.70 ms over a yamux stream, 0.21 ms
over Noise on a connection of its own and 0.14 ms over bare TCP; after 10 ms idle, as a
pipeline stage sits between its steps, 1.71, 0.72 and 0.46 ms. A decode step through three
peers crosses four such streams.

What. The protocols in `DEDICATED_PROTOCOLS` (one frame per decode step each) may run on a
connection of their own: TCP, the swarm key's pnet protector when the swarm has one, and
libp2p's own Noise XX handshake with the hosts' libp2p identities. It carries exactly one
stream, so there is no muxer: a message is Noise's transport framing (a 2-byte length and
the ChaCha20-Poly1305 ciphertext) read straight off the socket. The handlers are the ones
the libp2p host runs; a `DedicatedStream` is a `Stream` like any other.

When. Only where it works at once:

- the libp2p connection to the peer is direct (not relayed, and not hole-punched: a
  punched hole covers the libp2p port, not this one);
- the peer told us (`DedicatedEndpoint`, asked once over libp2p and kept `ENDPOINT_TTL`)
  that it listens on the address our libp2p connection reaches it at. An address it does
  not list was rewritten by a NAT on the way, whose mapping is the libp2p port's.

Anything else — a peer without the protocol, a refused or timed-out dial, a failed
handshake — falls back to a libp2p stream, and that peer's dedicated path is avoided for
a while (`Backoff`, doubling from `AVOID_BASE`); a peer busy with our connections or not
serving that protocol there gets a libp2p stream without a strike. A failing attempt
costs a session at most `ENDPOINT_TIMEOUT` + `DIAL_TIMEOUT` (4 s), once per avoidance.

Security. As a libp2p stream's: Noise XX authenticates both ends' peer ids (a dialler
checks it reached the peer it meant; the listener learns who dialled, as a stream handler
does from libp2p) and encrypts everything after the handshake; pnet keeps out a host
without the swarm key; activations are sealed per link on top, as always. An observer
of the network sees one TCP connection per stream instead of one per pair of peers, so
how many sessions and links a peer runs shows. What a stranger can hold is bounded
(`DedicatedLimits`): handshakes in progress, in all and per source address, each for at
most `HANDSHAKE_TIMEOUT`, with a 1 KiB frame limit until the protocol is named; a refused
connection is dropped within that time. Past the handshake a stream is the protocol's,
with the protocol's own limits, as on a libp2p stream. Connections we dial count apart
from those we accept, so that strangers cannot use up our own.

Closing. `close()` half-closes, as on yamux: the remote reads what was sent, then end of
stream, and may still send; this end may go on reading. A closed stream nobody reads is
drained in the background (up to `DRAIN_LIMIT`, for `LINGER`) until the remote closes too,
then released: closing the socket at once could answer the remote's last frames with a
reset, which loses what the remote had not read yet. `reset()` aborts the connection (an
RST). A stream dropped without either is released when it is collected, as a socket is.
"""
