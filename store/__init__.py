"""What a peer remembers: its sqlite database (tessera.store.db), trace (tessera.store.trace, whose
events are the classes of tessera.store.events), key file (tessera.store.keyfile), and the merged,
clock-aligned views of many peers' traces (tessera.store.timeline, tessera.store.export,
tessera.store.plot). Depends on sqlite-utils and the stdlib only (matplotlib for tessera.store.plot,
imported when a plot is drawn). Import what you use from its module."""
