"""The server: its listener, HTTP side, access, command line, deployment, WebSocket compat."""
