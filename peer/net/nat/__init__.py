"""Behind NAT: reachability, dial-back, link kinds, relays and hole punching."""
