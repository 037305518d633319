"""HTTP layer: the OpenAI-compatible gateway over one `Swarm`."""
