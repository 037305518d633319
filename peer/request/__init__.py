"""Request layer: the requester's side (chains, groups, repair, decoding, checks)."""
