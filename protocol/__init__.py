"""protocol/ — what crosses the wire. Pure: no I/O, no clocks, no libp2p.

Every decoder here returns a valid value or raises a `tessera.protocol.errors.WireError`
subclass; nothing else escapes, whatever the bytes.

    errors       the exception hierarchy (one class per failure condition)
    cbor         the strict CBOR subset and its bounded decoder
    schema       field types and limits: annotations -> validators; the registry
    codec        encode/decode of registered messages; PROTOCOL_VERSION
    messages     session messages (SessionOpen, Forward, Result, ...) + re-exports
    records      swarm messages (PeerRecord, SignedRecord, GossipPush, ...)
    tensors      the tensor codec (dtype + shape + raw little-endian bytes)
    framing      length-prefixed frames with a hard size limit
    keys         Ed25519 identities, peer ids, X25519 ephemeral keys
    links        sealed link keys and the XChaCha20-Poly1305 link cipher
    crypto       signed records, swarm key proofs, + re-exports of keys and links
    activations  a tensor into a Forward/Result frame and back
    fuzz         seeded mutation fuzzing of every decoder (tests and bench/fuzz.py)

Import the submodule you need (`from tessera.protocol.messages import Forward`); this
package imports nothing itself, so that message code does not pull in torch.
"""
