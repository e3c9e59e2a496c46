"""weightcache: keep model weights resident in a sidecar daemon; engines attach zero-copy."""
