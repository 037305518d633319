"""Net layer: the transport interface and its implementations, gossip, NAT."""
