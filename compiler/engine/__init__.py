"""The runtime side of a built model: the cache plan, the engine core (caches, per-row state, row
and batch operations), its runners (how a step executes), MTP."""
