"""Base layer: what every other layer of peer/ may use (errors, ids, protocol ids)."""
