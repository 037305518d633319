"""CLI layer: the `tessera` command line, the demo and swarm status (may import tui/)."""
