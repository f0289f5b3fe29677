"""`swiftdecode serve --ray`: the OpenAI-compatible server on Ray Serve, replicas behind one ingress.

Modules: `asgi` (a request as the ingress received it, replayed into a replica's app), `replica` (one engine: the
single-machine server app), `ingress` (forwarding, prefix-affinity routing text, failover), `board` (/metrics
across replicas), `deploy` (the Ray Serve application and `serve --ray`). Needs the `cluster` extra (Ray Serve).
"""
