"""Serve layer: the volunteer's side of a session (stage servers, shard servers)."""
