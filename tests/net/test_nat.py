"""Behind NAT: dial-back reachability, relay reservations, hole punching and link kinds.

Two kinds of test:

- in one process on 127.0.0.1 (no privileges): the dial-back protocol and its
  verdicts, a lying helper, reservations (renewal, relays that appear later),
  relayed connections, their upgrade to direct ones, and how `connection_kind`,
  the link log, the trace and the links protocol name them;
- on a real NAT topology (`tests/netns.py`: network namespaces, veth pairs,
  iptables; root only): real `tessera peer` processes behind two NAT routers and a
  bootstrap/relay peer on the public side. A requester on the public side runs
  `tessera generate --json` through them. Through routers that drop unsolicited
  SYNs the two private peers end up hole-punched; through routers that answer RST
  they stay relayed; either way the answer is the reference's, token for token.
"""

from __future__ import annotations

import json
import re
import socket
import sys
import time
from pathlib import Path

import pytest
import trio

from tessera.peer.net.gossip import ViewKeeper
from tessera.peer.base.ids import peer_id_text
from tessera.peer.net.pinger import Pinger
from tessera.peer.net.libp2p import open_libp2p_transport
from tessera.peer.net.nat.reachability import PRIVATE, PUBLIC, UNKNOWN, NatService
from tessera.peer.base.protocols import DIALBACK_PROTOCOL
from tessera.peer.net.nat.dialback import DialBackRequest, DialBackResult, dialback_addrs
from tessera.peer.net.nat.links import ask_links
from tessera.peer.net.transport import DIRECT, RELAYED, Channel
from tessera.peer.base.protocols import PING_PROTOCOL
from tessera.protocol.codec import decode, encode
from tessera.protocol.crypto import sign_record
from tessera.protocol.errors import WireError
from tessera.protocol.keys import Identity
from tessera.protocol.records import PeerRecord
from tessera.stages.decoding.generate import prompt_ids
from tessera.store.events import Connect
from tessera.store.trace import MemoryTracer

from .. import netns
from ..conftest import FRANCE
from ..waiting import await_until

MODEL_ID = "m" * 16
NUM_LAYERS = 4


def signed_record(identity: Identity, *, reachability: str, addrs: tuple[str, ...]):
    now = time.time()
    return sign_record(identity, PeerRecord(
        peer_id=identity.peer_id, name="", model_id=MODEL_ID, start=0, end=NUM_LAYERS, shard_index=0, shard_count=1,
        throughput=1.0, free_memory=0, load=0.0, max_sessions=1, state="serving", reachability=reachability,
        addrs=addrs, neighbours=(), issued_at=now, expires_at=now + 60, seq=int(now * 1000),
    ))


def keeper() -> ViewKeeper:
    return ViewKeeper(model_id=MODEL_ID, num_layers=NUM_LAYERS, clock=time.time)


# -- the dial-back protocol, pure parts ------------------------------------------------


def test_dialback_dials_only_the_observed_ip_at_the_listen_ports() -> None:
    me = peer_id_text(Identity.generate().peer_id)
    listen = (f"/ip4/192.0.2.2/tcp/4001/p2p/{me}", "/ip4/10.0.0.5/tcp/4002", "/ip4/192.0.2.2/udp/9/quic-v1", "garbage")
    assert dialback_addrs("/ip4/203.0.113.11/tcp/51234", listen, me) == [
        f"/ip4/203.0.113.11/tcp/4001/p2p/{me}",
        f"/ip4/203.0.113.11/tcp/4002/p2p/{me}",
    ]
    assert dialback_addrs("not an address", listen, me) == []


def test_dialback_messages_round_trip_and_reject_bad_fields() -> None:
    request = DialBackRequest(bytes(16), ("/ip4/192.0.2.2/tcp/4001",))
    assert decode(encode(request)) == request
    result = DialBackResult(bytes(range(16)), "/ip4/203.0.113.11/tcp/5", ("/ip4/203.0.113.11/tcp/4001",), ())
    assert decode(encode(result)) == result
    with pytest.raises(WireError):
        encode(DialBackRequest(bytes(15), ()))  # a nonce is 16 bytes
    with pytest.raises(WireError):
        encode(DialBackRequest(bytes(16), tuple(f"/ip4/192.0.2.2/tcp/{p}" for p in range(9))))  # at most 8


# -- reachability on loopback -------------------------------------------------------------


async def test_a_listening_peer_is_found_public_and_advertises_what_was_reached() -> None:
    async with open_libp2p_transport(Identity.generate().seed) as asker, \
            open_libp2p_transport(Identity.generate().seed) as helper:
        nat = NatService(asker, keeper(), out=lambda line: None, trust_loopback=False)
        NatService(helper, keeper(), out=lambda line: None, trust_loopback=False)
        assert nat.verdict == UNKNOWN and nat.advertised() == asker.listen_addrs()
        assert await nat.check_reachability() == UNKNOWN  # nobody to ask yet
        await asker.connect(helper.addrs()[0])
        assert await nat.check_reachability() == PUBLIC
        assert nat.advertised() == asker.listen_addrs() == asker.addrs()
        assert nat.reachability == "public" and asker.relay.hop_enabled  # a public peer relays for others


async def test_a_connected_requester_is_not_asked_to_dial_back_while_a_peer_of_the_view_is() -> None:
    # A requester serves no dial-backs: asking it only has libp2p log a refused protocol here. It is
    # asked only while no peer the view holds is connected (a record not merged yet).
    helper_identity = Identity.generate()
    async with open_libp2p_transport(Identity.generate().seed) as asker, \
            open_libp2p_transport(helper_identity.seed) as helper, \
            open_libp2p_transport(Identity.generate().seed) as requester:
        view = keeper()
        nat = NatService(asker, view, out=lambda line: None, trust_loopback=False)
        NatService(helper, keeper(), out=lambda line: None, trust_loopback=False)
        await asker.connect(helper.addrs()[0])
        await requester.connect(asker.addrs()[0])
        await await_until(lambda: len(asker.connected()) == 2, 10, "both connections")
        assert sorted(nat.helpers()) == sorted([helper.peer_id, requester.peer_id])  # the view is empty
        view.merge([signed_record(helper_identity, reachability="public", addrs=tuple(helper.addrs()))])
        assert nat.helpers() == [helper.peer_id]
        assert await nat.check_reachability() == PUBLIC


async def test_nothing_listening_on_the_named_port_means_private() -> None:
    async with open_libp2p_transport(Identity.generate().seed) as asker, \
            open_libp2p_transport(Identity.generate().seed) as helper:
        NatService(helper, keeper(), out=lambda line: None, trust_loopback=False)
        nat = NatService(asker, keeper(), out=lambda line: None, trust_loopback=False)
        # As behind a NAT: the port others would have to dial leads nowhere.
        closed = free_port()
        nat.dialback.listen_addrs = lambda: [f"/ip4/127.0.0.1/tcp/{closed}/p2p/{asker.peer_id}"]
        await asker.connect(helper.addrs()[0])
        assert await nat.check_reachability() == PRIVATE
        assert nat.advertised() == [] and nat.reachability == "private"
        assert not asker.relay.hop_enabled


async def test_a_helper_that_claims_success_without_dialling_is_not_believed() -> None:
    async with open_libp2p_transport(Identity.generate().seed) as asker, \
            open_libp2p_transport(Identity.generate().seed) as liar:

        async def lie(stream) -> None:
            channel = Channel(stream)
            request = await channel.receive()
            claimed = (f"/ip4/127.0.0.1/tcp/1/p2p/{stream.remote}",)
            await channel.send(DialBackResult(request.nonce, "/ip4/127.0.0.1/tcp/2", claimed, claimed))
            await channel.close()

        liar.set_handler(DIALBACK_PROTOCOL, lie)
        nat = NatService(asker, keeper(), out=lambda line: None, trust_loopback=False)
        await asker.connect(liar.addrs()[0])
        outcome = await nat.dialback.check(liar.peer_id)
        assert outcome is not None and outcome.tried and outcome.reached == ()
        assert await nat.check_reachability() == PRIVATE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- relays and link kinds on loopback ---------------------------------------------------


async def test_private_peer_reserves_on_a_relay_that_appears_later_renews_and_is_reachable() -> None:
    relay_id, private_id = Identity.generate(), Identity.generate()
    async with open_libp2p_transport(relay_id.seed) as relay, \
            open_libp2p_transport(private_id.seed) as private, \
            open_libp2p_transport(Identity.generate().seed) as stranger:
        relay.relay.enable_hop()
        view = keeper()
        lines: list[str] = []
        nat = NatService(private, view, out=lines.append, trust_loopback=False)
        nat.verdict = PRIVATE  # as the dial-back check would find behind a NAT
        async with trio.open_nursery() as nursery:
            nursery.start_soon(nat._relay_loop)
            await trio.sleep(0.3)
            assert nat.relay_addrs == {} and nat.advertised() == []  # no public peer known yet
            view.merge([signed_record(relay_id, reachability=PUBLIC, addrs=tuple(relay.addrs()))])
            await await_until(lambda: relay.peer_id in nat.relay_addrs, 10, "a reservation on the new relay")
            circuit = nat.relay_addrs[relay.peer_id]
            assert circuit == f"{relay.addrs()[0]}/p2p-circuit/p2p/{private.peer_id}"
            assert nat.advertised() == [circuit] == private.addrs()
            assert any("reserved a slot" in line for line in lines)

            # Renewal: a reservation with little time left is renewed (the relay extends it).
            private.relay.reservations[relay.peer_id] = time.time() + 5
            await await_until(lambda: private.relay.reservations[relay.peer_id] > time.time() + 60, 10, "renewal")
            nursery.cancel_scope.cancel()

        # Someone who knows only the advertised address gets through, over the relay.
        assert await stranger.connect(circuit) == private.peer_id
        assert stranger.connection_kind(private.peer_id) == RELAYED
        assert private.connection_kind(stranger.peer_id) == RELAYED
        assert stranger.connection_kind(relay.peer_id) == DIRECT


async def test_peers_meeting_over_a_relay_upgrade_to_direct_when_one_is_dialable() -> None:
    """DCUtR's first step: if the other side is dialable after all (here: on loopback), a plain
    direct dial replaces the relay. That connection is DIRECT, not PUNCHED — PUNCHED is kept
    for connections a hole punch made (shown on the NAT topology below) — and new streams use it."""
    async with open_libp2p_transport(Identity.generate().seed) as relay, \
            open_libp2p_transport(Identity.generate().seed) as a, \
            open_libp2p_transport(Identity.generate().seed) as b:
        relay.relay.enable_hop()
        await a.connect(relay.addrs()[0])
        assert await a.relay.reserve(relay.peer_id) > time.time()
        lines: list[str] = []
        tracer = MemoryTracer()
        nat = NatService(b, keeper(), out=lines.append, tracer=tracer, trust_loopback=False)
        await b.connect(f"{relay.addrs()[0]}/p2p-circuit/p2p/{a.peer_id}")
        nat.poll_links()
        assert nat.links[a.peer_id] == RELAYED
        await await_until(lambda: b.connection_kind(a.peer_id) == DIRECT, 30, "the upgrade to a direct connection")
        assert a.connection_kind(b.peer_id) == DIRECT
        nat.poll_links()
        assert f"link {a.peer_id}: relayed -> direct" in lines
        kinds = [(e.event.remote, e.event.link) for e in tracer.of_kind(Connect)]
        assert sorted(kinds[:2]) == sorted([(a.peer_id, RELAYED), (relay.peer_id, DIRECT)])
        assert kinds[2:] == [(a.peer_id, DIRECT)]
        assert not b.relay.puncher.punched and nat.punched == set()
        assert await ask_links(a, b.peer_id) == {a.peer_id: DIRECT, relay.peer_id: DIRECT}  # b's answer
        Pinger(a)
        stream = await b.open_stream(a.peer_id, PING_PROTOCOL)
        assert stream.remote_addr is not None  # the new stream runs on the direct connection
        await stream.reset()


# -- the real NAT topology (root) ---------------------------------------------------------

SKIP = netns.skip_reason()
PY = sys.executable
PEER_START = 90.0  # import torch, measure a layer, load a span: ~10 s alone, more on 2 busy cores
SETTLE = 60.0  # dial-back verdicts (3 s), reservations, the first relayed connection and the punch
GENERATE_TIMEOUT = 120.0
MAX_NEW = 16


def wait_for_line(path: Path, pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, path.read_text())
        if found:
            return found
        time.sleep(0.25)
    raise AssertionError(f"{pattern!r} did not appear in {path.name} within {timeout} s:\n{path.read_text()[-3000:]}")


def start_peer(topo: netns.NatTopology, role: str, name: str, layers: str, tmp: Path, join: str | None = None,
               *, listen: str | None = None) -> Path:
    log = tmp / f"{name}.log"
    cmd = [PY, "-m", "tessera.peer.cli.main", "peer", "--threads", "1", "--listen", listen or f"/ip4/{topo.ip(role)}/tcp/4001",
           "--layers", layers, "--name", name, "--data-dir", str(tmp / name)]
    if join:
        cmd += ["--join", join]
    topo.spawn(role, cmd, log_path=str(log), env={"PYTHONUNBUFFERED": "1"})
    return log


def nat_swarm(topo: netns.NatTopology, tmp: Path) -> dict:
    """Relay/bootstrap peer on pub, A behind r1, B behind r2; returns their ids, addresses and logs.

    B listens on 0.0.0.0 (as a volunteer at home would), A on its LAN address.
    """
    # The relay serves one layer: a route may end on it (it answers the requester over a direct
    # link where B's would be relayed), but never needs it.
    relay_log = start_peer(topo, "pub", "relay", "29:30", tmp)
    relay_addr = wait_for_line(relay_log, r"listening on (/\S+)", PEER_START).group(1)
    logs = {"A": start_peer(topo, "a", "A", "0:15", tmp, relay_addr),
            "B": start_peer(topo, "b", "B", "15:30", tmp, relay_addr, listen="/ip4/0.0.0.0/tcp/4001")}
    ids = {name: wait_for_line(log, r"listening on \S+/p2p/(\w+)", PEER_START).group(1) for name, log in logs.items()}
    for log in logs.values():
        wait_for_line(log, r"serving layers", PEER_START)
        wait_for_line(log, r"reachability: private", SETTLE)
        wait_for_line(log, r"relay: reserved a slot", SETTLE)
    wait_for_line(relay_log, r"reachability: public", SETTLE)
    return {"relay": relay_addr, "ids": ids, "logs": logs, "relay_log": relay_log}


def swarm_status(topo: netns.NatTopology, relay_addr: str) -> dict:
    done = topo.output("pub", [PY, "-m", "tessera.peer.cli.main", "swarm", "status", "--json", "--join", relay_addr], timeout=60)
    assert done.returncode == 0, done.stderr
    return {p["name"]: p for p in json.loads(done.stdout)["peers"]}


def generate(topo: netns.NatTopology, relay_addr: str) -> dict:
    done = topo.output("pub", [PY, "-m", "tessera.peer.cli.main", "generate", FRANCE, "--json", "--threads", "1",
                               "--max-tokens", str(MAX_NEW), "--join", relay_addr], timeout=GENERATE_TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_advertised_addrs(status: dict, relay_addr: str) -> None:
    """Private peers advertise only their relayed address; the relay its public one."""
    assert status["relay"]["reachability"] == "public"
    assert status["relay"]["addrs"] == [relay_addr]
    for name in ("A", "B"):
        assert status[name]["addrs"] == [f"{relay_addr}/p2p-circuit/p2p/{status[name]['peer_id']}"]


@pytest.fixture
def reference_tokens(local_engine, smol_tokenizer) -> list[int]:
    return local_engine.generate_ids(prompt_ids(smol_tokenizer, FRANCE, raw=False), max_new_tokens=MAX_NEW)


@pytest.fixture(params=netns.VARIANTS)
def topology(request):
    if SKIP:
        pytest.skip(SKIP)
    with netns.nat_topology(request.param) as topo:
        yield topo


@pytest.mark.netns
@pytest.mark.slow
def test_behind_two_nats_the_answer_is_exact_punched_or_relayed(topology, tmp_path, reference_tokens) -> None:
    swarm = nat_swarm(topology, tmp_path)
    a, b = swarm["ids"]["A"], swarm["ids"]["B"]
    log_a, log_b = swarm["logs"]["A"], swarm["logs"]["B"]
    if topology.variant == "drop":
        # A NAT that drops unsolicited SYNs lets a simultaneous open through: punched, both
        # ends, before the session starts — so all of its traffic takes the direct link.
        # (A link is logged when its kind changes, polled every second: a fast punch may
        # be logged as punched straight away; the punch line says they met over a relay.)
        for log, other in ((log_a, b), (log_b, a)):
            wait_for_line(log, rf"hole punch with {other}: succeeded", SETTLE)
            wait_for_line(log, rf"link {other}: (relayed -> )?punched", SETTLE)
        expected_reach, expected_link = "hole-punched", "punched"
    else:
        # A NAT that answers RST kills it: the punch fails (while the answer is generated)
        # and the link stays relayed.
        wait_for_line(log_a, rf"link {b}: relayed", SETTLE)
        expected_reach, expected_link = "relayed", "relayed"

    answer = generate(topology, swarm["relay"])
    assert answer["tokens"] == reference_tokens
    route = [(h["peer"], h["start"], h["end"]) for h in answer["route"]]
    assert route[:2] == [(a, 0, 15), (b, 15, route[1][2])], route  # A hands over to B
    assert [hop[1:] for hop in route[1:]] in ([(15, 30)], [(15, 29), (29, 30)]), route  # B ends it, or the relay
    if topology.variant == "reject":
        wait_for_line(log_a, rf"hole punch with {b}: failed", SETTLE)
        wait_for_line(log_b, rf"hole punch with {a}: failed", SETTLE)

    # A status lists the links each peer holds when asked; one that idled out after the answer
    # (a loaded box spaces the peers' keep-alives) is dialled again by gossip: ask until both show.
    deadline = time.monotonic() + SETTLE
    while True:
        status = swarm_status(topology, swarm["relay"])
        if (b in status["A"]["links"] and a in status["B"]["links"]) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    check_advertised_addrs(status, swarm["relay"])
    relay_id = status["relay"]["peer_id"]
    for name, other in (("A", b), ("B", a)):
        assert status[name]["reachability"] == expected_reach, status[name]
        assert status[name]["links"][other] == expected_link, status[name]  # as the peer itself sees it
        assert status[name]["links"][relay_id] == "direct"  # it dialled out to the public relay

    # The link A -> B carried the session; its kind never changed while it did, and it was
    # never a plain direct one (private addresses are not dialled, nor advertised).
    for log, other in ((log_a, b), (log_b, a)):
        kinds = re.findall(rf"link {other}: (?:\w+ -> )?(\w+)", log.read_text())
        assert kinds and kinds[-1] == expected_link and "direct" not in kinds, kinds
        if expected_link == "relayed":
            assert kinds == ["relayed"], kinds
