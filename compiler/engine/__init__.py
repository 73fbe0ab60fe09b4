"""The runtime side of a built model: the cache plan, the prefill/decode graphs, MTP."""
