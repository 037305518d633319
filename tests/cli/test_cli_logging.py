"""What the command line prints on stderr: libp2p's records folded to one line each (peer/cli/log_setup.py)."""

from __future__ import annotations

import asyncio
import io
import logging
import os

import pytest

from tessera.peer.cli.log_setup import LIBP2P, OneLinePerEvent, fold, install
from tessera.tui.terminal import driver_for, logs_to, ui_terminal

# What py-libp2p's basic_host logs when a stream to a peer that went away cannot open (8 lines).
DUMP = ("Failed to open stream to peer 12D3KooWAbc:\n  Error: failed to upgrade\n  Protocols: ['/tessera/1']\n"
        "  Timeout: 5s\n  Connection: SwarmConn\n  Connection State: established=True, handshake=True\n"
        "  Registry Stats: None")


def record(name: str, msg: str, level: int = logging.ERROR, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(exc), exc, None) if exc else None
    return logging.LogRecord(name, level, __file__, 1, msg, (), exc_info)


def test_a_dump_folds_into_what_and_why():
    assert fold(record("libp2p.host.basic_host", DUMP)) == "Failed to open stream to peer 12D3KooWAbc: failed to upgrade"
    assert fold(record("libp2p.transport.tcp.tcp", "Failed to open TCP stream: %s")) == "Failed to open TCP stream: %s"
    boom = ConnectionResetError("peer reset\nsecond line")
    assert fold(record("libp2p.network", "stream handler failed", exc=boom)) == \
        "stream handler failed: ConnectionResetError: peer reset"


def test_one_line_per_event_then_a_count():
    now = [0.0]
    flt = OneLinePerEvent(window=600.0, clock=lambda: now[0])
    first = record("libp2p.transport.tcp.tcp", "Failed to open TCP stream: all attempts to connect to 127.0.0.1:1 failed")
    assert flt.filter(first) and first.levelno == logging.WARNING and first.getMessage().startswith("Failed")
    assert flt.filter(first)  # the same record again (a second handler): the same verdict, not a repeat
    for t in (10.0, 20.0, 300.0):  # the dead peer redialled every round
        now[0] = t
        assert not flt.filter(record(first.name, first.msg))
    other = record(first.name, "Failed to open TCP stream: all attempts to connect to 127.0.0.1:2 failed")
    assert flt.filter(other)  # another peer: another event
    now[0] = 700.0
    again = record(first.name, first.msg)
    assert flt.filter(again) and again.getMessage().endswith("(and 3 times more in the last 10 min)")
    assert not flt.filter(record("libp2p.network.auto_connector", "AUTO_CONNECTOR_STATE", logging.WARNING))
    ours = record("tessera.peer.net.gossip", "two\nlines")
    assert flt.filter(ours) and ours.getMessage() == "two\nlines"  # our own records are ours to word


def test_a_dead_peer_reported_by_three_layers_is_one_line():
    """What a survivor's libp2p logged when a neighbour was killed (seen on loopback): the protocol
    negotiation, the host (naming the peer), then the transport's redial (naming its address)."""
    now = [100.0]
    flt = OneLinePerEvent(clock=lambda: now[0])
    dead, other = "12D3KooWK7zfsexngmqznB34KDT3qFJxRPXSmGagzfyPeGeYM2Ab", "12D3KooWSyDPiPin3gbJtr6D4Um7G2UUeBZpaYnJxshmQJ8V68Br"
    redial = ("libp2p.transport.tcp.tcp", "Failed to open TCP stream: all attempts to connect to 127.0.0.1:45489 failed")
    seen = []
    for t, name, msg in [
        (0.0, "libp2p.protocol_muxer.multiselect_client", "MultiselectClient handshake: read failed: fail to read"),
        (0.1, "libp2p.host.basic_host", DUMP.replace("12D3KooWAbc", dead)),
        (2.0, *redial),
        (3.0, "libp2p.host.basic_host", DUMP.replace("12D3KooWAbc", other)),  # another peer: another event
        (7.0, *redial), (60.0, *redial),  # the dead one, redialled every round
        (300.0, redial[0], redial[1].replace("45489", "45490")),  # first redial of a second address, long after
    ]:
        now[0] = 100.0 + t
        rec = record(name, msg)
        if flt.filter(rec):
            seen.append(rec.getMessage())
    assert seen == [f"Failed to open stream to peer {dead}: failed to upgrade",
                    f"Failed to open stream to peer {other}: failed to upgrade"]
    now[0] = 100.0 + 3.0 + flt.window + 1  # a window after the last peer's failure, an address alone is news
    assert flt.filter(record(*redial))


@pytest.fixture
def restore_logging():
    root, lib = logging.getLogger(), logging.getLogger(LIBP2P)
    saved = (list(root.handlers), root.level, list(lib.handlers), lib.level, lib.propagate)
    yield
    root.handlers[:], lib.handlers[:] = saved[0], saved[2]
    root.setLevel(saved[1])
    lib.setLevel(saved[3])
    lib.propagate = saved[4]


def test_install_quiet_and_verbose(restore_logging):
    out = io.StringIO()
    install(0, stream=out)  # quiet: ours only, none of libp2p's (issue 46: they read as faults to a newcomer)
    dump = logging.getLogger("libp2p.host.basic_host")
    for _ in range(3):
        dump.error(DUMP)
    logging.getLogger("libp2p.transport.tcp.tcp").info("dial tcp 127.0.0.1:1")
    logging.getLogger("libp2p.network.auto_connector").warning("AUTO_CONNECTOR_STATE: num_connections=0")
    logging.getLogger("libp2p.host.basic_host").error("protocols not supported: ['/tessera/dialback/1.0.0']")
    own_level = logging.getLogger("libp2p.own_level")
    own_level.setLevel(logging.WARNING)  # a libp2p logger that sets its own level
    own_level.warning("Failed to open TCP stream: all attempts to connect to 127.0.0.1:37351 failed")
    logging.getLogger("tessera.peer.net.gossip").warning("ours")
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].endswith("WARNING tessera.peer.net.gossip: ours"), lines

    out = io.StringIO()
    install(1, stream=out)  # -v: ours from INFO, libp2p's failures one line each
    for _ in range(3):
        dump.error(DUMP)
    logging.getLogger("libp2p.network.auto_connector").warning("AUTO_CONNECTOR_STATE: num_connections=0")
    logging.getLogger("tessera.peer.net.gossip").info("ours")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].endswith("WARNING libp2p.host.basic_host: Failed to open stream to peer 12D3KooWAbc: failed to upgrade")
    assert lines[1].endswith("INFO tessera.peer.net.gossip: ours")

    out = io.StringIO()
    install(2, stream=out)  # -vv: libp2p's lines as it wrote them, from DEBUG
    dump.error(DUMP)
    logging.getLogger("libp2p.transport.tcp.tcp").info("dial tcp 127.0.0.1:1")
    logging.getLogger("libp2p.network.auto_connector").warning("AUTO_CONNECTOR_STATE: num_connections=0")
    text = out.getvalue()
    assert "Registry Stats: None" in text and "dial tcp 127.0.0.1:1" in text and "AUTO_CONNECTOR" in text
    assert len([h for h in logging.getLogger().handlers if getattr(h, "tessera", False)]) == 1


def test_while_the_ui_runs_records_go_to_the_events(restore_logging, tmp_path):
    master, slave = os.openpty()
    with open(slave, "w") as terminal, open(tmp_path / "err.log", "w") as err:
        install(0, stream=terminal)
        shown: list[str] = []
        with logs_to(shown.append):
            logging.getLogger("tessera.peer.net.gossip").warning("while the UI draws")
        logging.getLogger("tessera.peer.net.gossip").warning("after")
        terminal.flush()
        assert shown == ["WARNING tessera.peer.net.gossip: while the UI draws"]
        drawn = os.read(master, 4096).decode()
        assert "after" in drawn and "while the UI draws" not in drawn  # nothing drawn over the UI

        install(1, stream=err)  # `-v 2>file`: the file keeps its log, and the events get it too
        shown.clear()
        with logs_to(shown.append):
            for _ in range(2):
                logging.getLogger("libp2p.host.basic_host").error(DUMP)
        err.flush()
        folded = "libp2p.host.basic_host: Failed to open stream to peer 12D3KooWAbc: failed to upgrade"
        assert [line.split(" ", 1)[1] for line in shown] == [folded]
        assert [line.split(" ", 2)[2] for line in (tmp_path / "err.log").read_text().splitlines()] == [folded]
    os.close(master)


def test_the_ui_draws_on_the_terminal_when_stderr_is_a_file(tmp_path):
    """`tessera peer --tui 2>file`: Textual would draw into the file; it draws on the terminal."""
    import fcntl
    import signal
    import struct
    import termios

    from textual.app import App

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 32, 100, 0, 0))
    handlers = signal.getsignal(signal.SIGTSTP), signal.getsignal(signal.SIGCONT)  # the driver sets them
    try:
        with open(slave, "w") as terminal, open(tmp_path / "err", "w") as err:
            with ui_terminal(stdout=terminal, stderr=err) as chosen:
                assert chosen is terminal

                async def make_driver():  # a driver takes the running loop
                    return driver_for(chosen)(App(), debug=False, mouse=False, size=None)

                driver = asyncio.run(make_driver())
                assert driver._file is terminal and driver._get_terminal_size() == (100, 32)
            with ui_terminal(stdout=err, stderr=terminal) as chosen:
                assert chosen is None and driver_for(chosen) is None  # stderr is the terminal: Textual's default
            with ui_terminal(stdout=err, stderr=err, tty=os.ttyname(slave)) as chosen:
                assert chosen.isatty()  # neither is: the controlling terminal
            assert chosen.closed
            with ui_terminal(stdout=err, stderr=err, tty=str(tmp_path / "no-dir" / "tty")) as chosen:
                assert chosen is None  # no terminal at all: leave it to Textual
    finally:
        signal.signal(signal.SIGTSTP, handlers[0])
        signal.signal(signal.SIGCONT, handlers[1])
        os.close(master)


def test_a_peer_that_went_away_as_we_spoke_is_no_warning():
    """Issue 34, item 6: after every answer, each peer of the route logged a libp2p WARNING about
    the requester, which had exited normally. Quiet by default; -v still shows it."""
    flt = OneLinePerEvent(window=600.0, clock=lambda: 0.0)
    gone = ("Failed to open stream to peer 12D3KooWEzj8GqHLh3bctQ11fm7MqFEmr5a6JJRR3iKD1QAAk5RH:\n"
            "  Error: handshake read failed: fail to read from multiselect communicator")
    assert not flt.filter(record("libp2p.host.basic_host", gone))
    assert flt.filter(record("libp2p.host.basic_host", DUMP))  # a real failure still says so, once
