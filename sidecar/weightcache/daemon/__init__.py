"""The sidecar daemon: load a checkpoint onto one device, hold it, serve it, report it."""
