"""Net layer: the transport interface and its implementations, gossip (record_set, reconcile, membership,
verified, pinger), NAT."""
