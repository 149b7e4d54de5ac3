"""How an echo2p2p process runs: logging and the event loop (`process`), and the deadlines of
every HTTP server it starts (`http_deadlines`). Used by both entry points and both servers.
"""
