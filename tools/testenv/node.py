"""A real Kubernetes node beside the kwok nodes: kubelet, containerd 1.6 and runc.

kubelet is the multi-call binary's fifth personality (same k8s.io/kubernetes
pin as the control plane); containerd and runc come from Debian (hostpkgs.py).
Both run in a network namespace of the node's own (netns.py) that holds only
`lo` with 127.0.0.1, the node's address and the `kubernetes` Service IP,
plus one veth per pod that is not hostNetwork; nothing in it can reach
anything but itself and, through bridge.py, the API server. Every process
the node starts lives in one cgroup subtree (cgroups.py), which is how
teardown (nodeclean.py) finds containers and containerd's shims (they
reparent away from us). What each piece is told is in nodeconfig.py.

Images come from a containerd root that outlives the run (a cache slot, see
`acquire_store`), so a warm run imports nothing; a second node running at the
same time gets a private root and imports what it needs.

Teardown (stop(), a guard process if the owner is SIGKILLed, or `testenv
down`) leaves no kubelet, containerd, shim or container process, no mount,
no namespace, no cgroup, no changed sysctl, and no container in the store.

For fault tests, kubelet and containerd can each be stopped and started
again, and the whole node restarted from its state on disk (`restart()`);
pods' sockets may live on `socket_root`, a small tmpfs of the node's own.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tools.testenv import cgroups, hostpkgs, kubeconfig, netns, pki
from tools.testenv.apiclient import ApiClient, ApiError
from tools.testenv.nodeclean import (
    CONTAINER_LOG_LINKS,
    SHIM_SOCKET_DIR,
    remove_dead_shim_sockets,
    run_ctr,
    scrub_store,
    teardown,
    unmount_all,
    write_state,
)
from tools.testenv.nodeconfig import (
    API_SERVICE_PORT,
    DEFAULT_NAME,
    KUBELET_SYSCTLS,
    NODE_IP,
    POD_SUBNET,
    SOCKET_ROOT_OPTIONS,
    Layout,
    cni_config,
    containerd_config,
    ctr_argv,
    kubelet_args,
    kubelet_config,
    rbac_bindings,
)
from tools.testenv.procs import ProcessGroup

STORE_SLOTS = 2
KUBELET_HEALTHZ_PORT = 10248  # kubelet's default, on healthzBindAddress (127.0.0.1)

Log = Callable[[str], None]


class NodeUnavailable(RuntimeError):
    """This machine cannot run the real node; the message names what is missing."""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- prerequisites --------------------------------------------------------------


def missing_prerequisites() -> list[str]:
    """What this machine lacks to run the node, each named with what it is for."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (kubelet and containerd mount, create cgroups and namespaces)")
    packages = hostpkgs.missing_packages()
    if packages:
        missing.append(f"Debian packages: {hostpkgs.describe(packages)}")
    if not cgroups.hierarchies():
        missing.append("a mounted cgroup filesystem under /sys/fs/cgroup")
    for tool in ("unshare", "nsenter", "ip", "mount"):
        if shutil.which(tool) is None:
            missing.append(f"the {tool} command")
    if "overlay" not in Path("/proc/filesystems").read_text():
        missing.append("the overlay filesystem (containerd's snapshotter)")
    return missing


# -- the image store ------------------------------------------------------------


def acquire_store(cache: Path, run: Path) -> tuple[Path, int | None]:
    """The first free cache slot (held with a lock until release), else a private root."""
    cache.mkdir(parents=True, exist_ok=True)
    for slot in range(STORE_SLOTS):
        fd = os.open(cache / f"containerd-{slot}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return cache / f"containerd-{slot}", fd
    return run / "store", None


# -- the node -------------------------------------------------------------------


# Given the ctr command line for the node's containerd, make it hold the node's images.
ImageLoader = Callable[[list[str], Log], None]


@dataclass(frozen=True)
class NodeSpec:
    """What a Cluster needs to add a real node: its images and where they are cached."""

    pause_image: str
    load_images: ImageLoader
    store_cache: Path
    name: str = DEFAULT_NAME


class RealNode:
    """One node. start() needs the running control plane; stop() is idempotent."""

    def __init__(
        self,
        run_dir: Path,
        store_cache: Path,
        binaries: Mapping[str, Path],
        pause_image: str,
        load_images: ImageLoader,
        name: str = DEFAULT_NAME,
        cluster_ip: str = "10.96.0.1",
        log: Log = _stderr,
    ) -> None:
        self.run_dir = run_dir
        self.store_cache = store_cache
        self.binaries = dict(binaries)
        self.pause_image = pause_image
        self.load_images = load_images
        self.name = name
        self.cluster_ip = cluster_ip
        self.log = log
        self.group = ProcessGroup()
        self.sockets = Path("/tmp", f"wc-node-{os.getpid()}-{os.urandom(3).hex()}")
        # Short (pods' socket paths start with it), a tmpfs of its own (see nodeconfig).
        self.socket_root = Path("/tmp", f"wc-sroot-{os.getpid()}-{os.urandom(3).hex()}")
        self.layout: Layout | None = None
        self._api: ApiClient | None = None
        self._store_lock: int | None = None
        self._guard: subprocess.Popen[bytes] | None = None
        self._guard_pipe: int | None = None

    @property
    def egress_socket(self) -> Path:
        """Where the API server's egress (to kubelet) goes; fixed before start()."""
        return self.sockets / "egress.sock"

    def ctr(self, *args: str, input: bytes | None = None,
            check: bool = True) -> subprocess.CompletedProcess[bytes]:
        assert self.layout is not None
        return run_ctr(self.layout, *args, input=input, check=check)

    def start(self, api: ApiClient, ca: pki.KeyPair, apiserver_port: int,
              timeout: float = 180.0) -> None:
        missing = missing_prerequisites()
        if missing:
            raise NodeUnavailable(
                "testenv: this machine cannot run the real node; missing: " + "; ".join(missing)
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.group = ProcessGroup()
        store, self._store_lock = acquire_store(self.store_cache, self.run_dir)
        store.mkdir(parents=True, exist_ok=True)
        layout = self.layout = resolved_layout(
            self.run_dir, store, self.sockets, self.socket_root, name=self.name,
            cgroup=f"weightcache-testenv-{os.getpid()}-{os.urandom(3).hex()}",
            cluster_ip=self.cluster_ip,
        )
        self._api = api
        record: dict[str, Any] = {"layout": asdict(layout), "sysctls": {},
                                  "created_dirs": []}
        write_state(layout, record)
        self._start_guard(layout)
        self.sockets.mkdir(mode=0o700, exist_ok=True)
        self.socket_root.mkdir(mode=0o755, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", SOCKET_ROOT_OPTIONS, "tmpfs",
                        str(self.socket_root)], check=True, capture_output=True)
        if layout.dirty_marker.exists():
            self.log(f"testenv: {store} was left dirty by an earlier run; scrubbing it")
            scrub_store(layout)

        for d in (Path("/run/containerd"), SHIM_SOCKET_DIR, CONTAINER_LOG_LINKS):
            if not d.exists():
                record["created_dirs"].append(str(d))
        write_state(layout, record)
        netns.create(layout.netns, [NODE_IP, self.cluster_ip])
        cgroups.create(layout.cgroup)

        certs = pki.generate_node(layout.path("pki"), ca, self.name, NODE_IP)
        user = kubeconfig.client_cert_user(certs.client.cert, certs.client.key)
        node_kubeconfig = kubeconfig.write(
            layout.path("kubelet.kubeconfig"),
            kubeconfig.render(f"https://{self.cluster_ip}:{API_SERVICE_PORT}",
                              ca.cert.read_bytes(), user),
        )
        for binding in rbac_bindings():
            try:
                api.post("/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", binding)
            except ApiError as e:
                if e.status != 409:
                    raise

        layout.cni_conf_dir.mkdir(parents=True, exist_ok=True)
        (layout.cni_conf_dir / "10-ptp.conflist").write_text(json.dumps(cni_config(layout)))
        containerd_toml = layout.path("containerd.toml")
        containerd_toml.write_text(containerd_config(layout, self.pause_image))
        kubelet_yaml = layout.path("kubelet.yaml")
        kubelet_yaml.write_text(json.dumps(kubelet_config(layout, ca.cert, certs.serving),
                                           indent=2))
        logs = layout.path("logs")
        logs.mkdir(exist_ok=True)

        repo = Path(__file__).resolve().parents[2]
        self.group.spawn(
            "bridge",
            [sys.executable, "-m", "tools.testenv.bridge", f"--netns={layout.netns}",
             f"--listen={self.cluster_ip}:{API_SERVICE_PORT}", f"--upstream={apiserver_port}",
             f"--egress-socket={layout.egress_socket}", f"--allow={NODE_IP}/32",
             f"--allow={POD_SUBNET}"],
            logs / "bridge.log", env={**os.environ, "PYTHONPATH": str(repo)}, cwd=repo,
        )
        deadline = time.monotonic() + timeout
        self._wait("the bridge into the node's namespace", deadline,
                   lambda: layout.egress_socket.exists() and _listening_in(
                       layout.netns, self.cluster_ip, API_SERVICE_PORT))

        def join() -> None:
            # Not the caller's umask: containerd creates the snapshot and rootfs
            # directories every container's uid must be able to enter.
            os.umask(0o022)
            cgroups.join_runtime(layout.cgroup)

        self.group.spawn(
            "containerd",
            ["nsenter", f"--net={layout.netns}", "--", "containerd",
             f"--config={containerd_toml}"],
            logs / "containerd.log", before_exec=join,
        )
        self._wait("containerd", deadline,
                   lambda: self.ctr("version", check=False).returncode == 0)
        self.log(f"testenv: containerd up (image store {store})")
        self.load_images(ctr_argv(layout), self.log)

        share_kubelet_root(layout.kubelet_root)
        for name in KUBELET_SYSCTLS:
            with contextlib.suppress(OSError):
                record["sysctls"][name] = Path("/proc/sys", name).read_text().strip()
        write_state(layout, record)
        self.group.spawn(
            "kubelet",
            ["nsenter", f"--net={layout.netns}", "--", str(self.binaries["kubelet"]),
             *kubelet_args(layout, kubelet_yaml, node_kubeconfig)],
            logs / "kubelet.log", before_exec=join,
        )
        self._wait_node_ready(timeout)

    # -- faults: a platform team's restarts, for the tests ----------------------------

    def stop_kubelet(self, sig: int = signal.SIGTERM) -> int:
        """Stop kubelet alone (containers, shims and containerd keep running); its status."""
        return self.group.stop_one("kubelet", sig)

    def start_kubelet(self, timeout: float = 180.0) -> None:
        """Start kubelet again on the same configuration and root directory; wait for Ready."""
        self.group.respawn("kubelet")
        self._wait_node_ready(timeout)

    def stop_containerd(self, sig: int = signal.SIGTERM) -> int:
        """Stop containerd alone (the shims keep the containers running); its status."""
        return self.group.stop_one("containerd", sig)

    def start_containerd(self, timeout: float = 180.0) -> None:
        """Start containerd again on the same root, state and configuration; it takes the
        running containers back through their shims."""
        self.group.respawn("containerd")
        self._wait("containerd", time.monotonic() + timeout,
                   lambda: self.ctr("version", check=False).returncode == 0)

    def restart(self, down_seconds: float = 0.0, timeout: float = 300.0) -> None:
        """The whole node restarted from its state on disk, as after a power cut.

        Every process of the node (kubelet, containerd, the shims, every container) is
        SIGKILLed at once; everything that would not survive a reboot goes: the node's
        mounts (containers' root filesystems, pod volumes, pod network namespaces),
        containerd's and runc's runtime state and the cgroups. Then, after
        `down_seconds`, containerd and kubelet start again on the same image store,
        kubelet root directory and configuration, and kubelet restarts the node's pods.
        What a machine's disk and network keep stays: the store, kubelet's directory,
        CNI's address leases, the socket root, the node's network namespace and the
        bridge to the API server.
        """
        assert self.layout is not None
        layout = self.layout
        stuck = cgroups.kill_all(layout.cgroup)
        if stuck:
            raise RuntimeError(f"testenv: node processes that would not die: {sorted(stuck)}")
        for name in ("kubelet", "containerd"):
            self.group.stop_one(name, signal.SIGKILL)
        left = unmount_all(layout.run, layout.store, layout.sockets, keep=(str(layout.netns),))
        if left:
            raise RuntimeError(f"testenv: mounts of the node left after its restart: {left}")
        for volatile in (layout.containerd_state, layout.runc_root):
            shutil.rmtree(volatile, ignore_errors=True)
        for sock in (layout.containerd_socket, Path(f"{layout.containerd_socket}.ttrpc")):
            sock.unlink(missing_ok=True)
        remove_dead_shim_sockets()
        left_cgroups = cgroups.remove(layout.cgroup)
        if left_cgroups:
            raise RuntimeError(f"testenv: cgroups left after the restart: {left_cgroups}")
        cgroups.create(layout.cgroup)
        time.sleep(down_seconds)
        # Its shared bind went with the node's mounts; a machine's boot shares / again.
        share_kubelet_root(layout.kubelet_root)
        self.start_containerd(timeout)
        self.start_kubelet(timeout)

    def _wait_node_ready(self, timeout: float) -> None:
        """kubelet answering its health check, and the node Ready (after a quick restart
        the node may never have stopped being Ready)."""
        assert self._api is not None and self.layout is not None
        api, netns_path = self._api, self.layout.netns
        self._wait(f"node {self.name} Ready (kubelet)", time.monotonic() + timeout,
                   lambda: _listening_in(netns_path, "127.0.0.1", KUBELET_HEALTHZ_PORT)
                   and _node_ready(api, self.name))

    def _wait(self, what: str, deadline: float, check: Callable[[], Any]) -> None:
        self.group.wait_for(what, deadline, check, (OSError, ApiError, KeyError, ValueError))

    def _start_guard(self, layout: Layout) -> None:
        """A process outside our group that tears the node down if we die without doing it."""
        read, write = os.pipe()
        repo = Path(__file__).resolve().parents[2]
        with open(layout.path("guard.log"), "ab") as out:
            self._guard = subprocess.Popen(
                [sys.executable, "-m", "tools.testenv.nodeclean", "guard", str(layout.state_file),
                 str(read)],
                pass_fds=(read,), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)},
            )
        os.close(read)
        self._guard_pipe = write

    def stop(self) -> None:
        """Idempotent: when it returns, nothing the node started is left (see module doc)."""
        if self.layout is None:
            return
        layout = self.layout
        layout.dirty_marker.touch()
        self.group.stop(grace=10.0)
        teardown(layout.state_file)
        if self._store_lock is not None:
            os.close(self._store_lock)
            self._store_lock = None
        if self._guard_pipe is not None:
            os.write(self._guard_pipe, b"done")
            os.close(self._guard_pipe)
            self._guard_pipe = None
        if self._guard is not None:
            self._guard.wait(timeout=30)
            self._guard = None
        self.layout = None


def resolved_layout(run: Path, store: Path, sockets: Path, socket_root: Path, *, name: str,
                    cgroup: str, cluster_ip: str) -> Layout:
    """The node's layout with every directory resolved (a HOME or TMPDIR reached through a
    symlink): see Layout. Parents that do not exist yet are taken as they are written."""
    return Layout(run=str(run.resolve()), store=str(store.resolve()), name=name, cgroup=cgroup,
                  cluster_ip=cluster_ip, sockets=str(sockets.resolve()),
                  socket_root=str(socket_root.resolve()))


def share_kubelet_root(root: Path) -> None:
    """Make kubelet's root directory a shared mount of its own (this machine's / is private).

    A CSI plugin mounts into pods' volume directories with `Bidirectional`
    propagation, which containerd grants only on a shared mount; the bind
    lies under the run directory, which teardown unmounts whole.
    """
    root.mkdir(parents=True, exist_ok=True)
    for args in (["--bind", str(root), str(root)], ["--make-rshared", str(root)]):
        result = subprocess.run(["mount", *args], capture_output=True, text=True)
        if result.returncode != 0:
            raise NodeUnavailable(f"testenv: mount {' '.join(args)}: {result.stderr.strip()}")


def _listening_in(ns: Path, host: str, port: int) -> bool:
    with netns.entered(ns), socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, port)) == 0


def _node_ready(api: ApiClient, name: str) -> bool:
    try:
        node = api.get(f"/api/v1/nodes/{name}")
    except ApiError as e:
        if e.status == 404:
            return False
        raise
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in node.get("status", {}).get("conditions", []))
