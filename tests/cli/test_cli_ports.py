"""A busy port is one line, from `tessera serve --port` and `tessera peer --web` (issue 46, item 2).

Before, both started (the peer joined and loaded its span first) and ended in a 130-150-line
ExceptionGroup from the HTTP server, ending in `Address already in use`.
"""

from __future__ import annotations

import socket

import pytest

from tessera.peer.cli.main import main

JOIN = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWLdc6XuAzhCZ7VyqEHqMpDxgDCB3fmzYbKSN3RSpS6m6E"


@pytest.fixture
def busy_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


@pytest.mark.parametrize("argv, option", [
    (["serve", "--join", JOIN, "--port"], "--port"),
    (["peer", "--name", "web", "--web"], "--web"),
])
def test_a_busy_port_is_one_line(argv, option, busy_port, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # a peer's default data dir: never the user's
    status = main([*argv, str(busy_port)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1
    assert err == [f"error: {option} {busy_port}: 127.0.0.1:{busy_port} is already in use (another `tessera serve` or "
                   f"peer web view, or another program); pick another port, or {option} 0 for any free one"], err
