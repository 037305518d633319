"""The web view: the Swarm, Chat and Peer pages `tessera serve` (and `tessera peer --web PORT`) serve.

Plain files in `static/` (HTML, one stylesheet, ES modules; nothing is built at install time
and nothing is loaded from another host) and a small JSON/SSE API beside the gateway's
(`peer/http/web/app.py`). What the pages show is read from the requester's or the peer's
own swarm view (`sources.py`), shaped by pure functions (`report.py`), and followed over
time by one sampler (`watch.py`).
"""
