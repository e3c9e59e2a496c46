"""Developer tooling for weightcache (not shipped in the distribution)."""
