"""A real local Kubernetes control plane for tests: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and kwok-simulated GPU nodes, built
from pinned Go modules and cached outside the checkout.

`python -m tools.testenv build|up|down|env`; tests use `tools.testenv.cluster.Cluster`.
"""
