"""How an echo2p2p process runs: logging and the event loop (`process`), the deadlines of
every HTTP server it starts (`http_deadlines`), and the progress bars of its long waits
(`progress`). Used by both entry points and both servers.
"""
