"""The `weightcache.dev` CSI node plugin: a cache's socket directory as an inline volume.

Engine pods in namespaces that forbid hostPath (Pod Security `baseline` or
`restricted`) get the daemon's sockets through an ephemeral inline CSI
volume instead, the pattern the SPIFFE CSI driver set for handing a node
agent's Unix socket to workloads. access.py decides (pure), mounts.py mounts,
server.py speaks CSI, kube.py asks the API server for the cache.
"""
