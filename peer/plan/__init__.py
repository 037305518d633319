"""Plan layer: pure decisions over a swarm view (no trio, torch, time or I/O)."""
