"""The overlay, as both planes run it: the chunk store, chunk serving over HTTP, tickets, downloads.

The hub and every peer serve chunks with `serving.chunk_handler` from what they hold; peers
fetch with `download.Download` by the hub's relay plan (`echo2p2p.relay`), into a
`store.ChunkStore`. This package does I/O (aiohttp, the event loop, threads for hashing); the
plan, the manifest and the chunk format it carries are pure, in the core.
"""
