"""Kubernetes operator for WeightCache resources (kopf)."""
