"""The devcluster's certificate authority, serving and client certificates, and service-account keys.

Identities follow what kubeadm issues, so RBAC sees the same users a real cluster has: the admin is
in `system:masters`, the controller manager and scheduler use their `system:kube-*` users and rely on
the bootstrap ClusterRoleBindings for them. The aggregation layer has its own CA, as kubeadm's front-proxy CA: the
API server proxies to an extension API server (prometheus-adapter) with the front-proxy client certificate, and
the extension trusts only that CA for the user it names.

Every file is created once and kept: a file that is missing is created (and whatever a new CA signs is signed
again), so a state folder from an earlier version gains what it lacks without losing its CA.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=365)
SERVICE_IP = "10.96.0.1"  # first address of the service CIDR: the `kubernetes` Service


@dataclass(frozen=True)
class ClientIdentity:
    """A client certificate's subject: CN is the user, O the groups."""

    file_stem: str
    user: str
    groups: tuple[str, ...] = ()


CLIENTS = (
    ClientIdentity("admin", "kubernetes-admin", ("system:masters",)),
    ClientIdentity("controller-manager", "system:kube-controller-manager"),
    ClientIdentity("scheduler", "system:kube-scheduler"),
    # kwok acts as the kubelet of every simulated node and updates their status and their pods.
    ClientIdentity("kwok", "kwok-controller", ("system:masters",)),
    # serves the custom metrics API; RBAC for it is in metrics.py
    ClientIdentity("prometheus-adapter", "tailor:prometheus-adapter"),
)
FRONT_PROXY_CLIENT = "front-proxy-client"  # the user the API server proxies as (--requestheader-allowed-names)
ADAPTER_SERVICE = ("prometheus-adapter", "tailor-metrics")  # name, namespace: the aggregator checks this name


def _new_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _write_key(path: Path, key: rsa.RSAPrivateKey) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _sign(subject: x509.Name, key: rsa.RSAPrivateKey, issuer: x509.Name, issuer_key: rsa.RSAPrivateKey,
          extensions: list[tuple[x509.ExtensionType, bool]]) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALIDITY))
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    return builder.sign(issuer_key, hashes.SHA256())


@dataclass(frozen=True)
class Pki:
    """Paths of the files the components are started with."""

    root: Path

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca.key"

    @property
    def serving_cert(self) -> Path:
        return self.root / "apiserver.crt"

    @property
    def serving_key(self) -> Path:
        return self.root / "apiserver.key"

    @property
    def service_account_key(self) -> Path:
        return self.root / "sa.key"

    @property
    def service_account_pub(self) -> Path:
        return self.root / "sa.pub"

    @property
    def front_proxy_ca_cert(self) -> Path:
        return self.root / "front-proxy-ca.crt"

    @property
    def front_proxy_ca_key(self) -> Path:
        return self.root / "front-proxy-ca.key"

    @property
    def adapter_serving_cert(self) -> Path:
        return self.root / "prometheus-adapter-serving.crt"

    @property
    def adapter_serving_key(self) -> Path:
        return self.root / "prometheus-adapter-serving.key"

    @property
    def kubelet_serving_cert(self) -> Path:
        """The executor's kubelet endpoint (container logs), on 127.0.0.1."""
        return self.root / "executor-kubelet.crt"

    @property
    def kubelet_serving_key(self) -> Path:
        return self.root / "executor-kubelet.key"

    def client_cert(self, stem: str) -> Path:
        return self.root / f"{stem}.crt"

    def client_key(self, stem: str) -> Path:
        return self.root / f"{stem}.key"


@dataclass(frozen=True)
class _Authority:
    name: x509.Name
    key: rsa.RSAPrivateKey
    fresh: bool  # created now: everything it signs is signed again


def _ensure_ca(cert_path: Path, key_path: Path, common_name: str) -> _Authority:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    if cert_path.is_file() and key_path.is_file():
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        assert isinstance(key, rsa.RSAPrivateKey)
        return _Authority(x509.load_pem_x509_certificate(cert_path.read_bytes()).subject, key, fresh=False)
    key = _new_key()
    _write_key(key_path, key)
    _write_cert(cert_path, _sign(name, key, name, key, [
        (x509.BasicConstraints(ca=True, path_length=None), True),
        (x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                       key_encipherment=False, data_encipherment=False, key_agreement=False,
                       encipher_only=False, decipher_only=False), True),
    ]))
    return _Authority(name, key, fresh=True)


def _ensure_leaf(cert_path: Path, key_path: Path, issuer: _Authority, subject: x509.Name,
                 usage: x509.ObjectIdentifier, more: list[tuple[x509.ExtensionType, bool]] | None = None) -> None:
    if cert_path.is_file() and key_path.is_file() and not issuer.fresh:
        return
    key = _new_key()
    _write_key(key_path, key)
    _write_cert(cert_path, _sign(subject, key, issuer.name, issuer.key, [
        (x509.BasicConstraints(ca=False, path_length=None), True),
        (x509.ExtendedKeyUsage([usage]), False),
        *(more or []),
    ]))


def _common_name(name: str, groups: tuple[str, ...] = ()) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]
                     + [x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in groups])


def _names(dns: list[str], ips: tuple[str, ...] = ("127.0.0.1",)) -> list[tuple[x509.ExtensionType, bool]]:
    """Subject alternative names: `dns` and `ips` (every server here listens on loopback)."""
    return [(x509.SubjectAlternativeName([*(x509.DNSName(n) for n in dns),
                                          *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips)]), False)]


def ensure_pki(root: Path) -> Pki:
    """Create under `root` whichever of the CAs, certificates and keys are missing."""
    pki = Pki(root)
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    ca = _ensure_ca(pki.ca_cert, pki.ca_key, "tailor-devcluster-ca")
    apiserver = _names(["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                        "kubernetes.default.svc.cluster.local"], ("127.0.0.1", SERVICE_IP))
    _ensure_leaf(pki.serving_cert, pki.serving_key, ca, _common_name("kube-apiserver"),
                 ExtendedKeyUsageOID.SERVER_AUTH, apiserver)
    for client in CLIENTS:
        _ensure_leaf(pki.client_cert(client.file_stem), pki.client_key(client.file_stem), ca,
                     _common_name(client.user, client.groups), ExtendedKeyUsageOID.CLIENT_AUTH)
    name, namespace = ADAPTER_SERVICE
    _ensure_leaf(pki.adapter_serving_cert, pki.adapter_serving_key, ca, _common_name(name),
                 ExtendedKeyUsageOID.SERVER_AUTH, _names(["localhost", f"{name}.{namespace}.svc"]))
    _ensure_leaf(pki.kubelet_serving_cert, pki.kubelet_serving_key, ca, _common_name("tailor-executor-kubelet"),
                 ExtendedKeyUsageOID.SERVER_AUTH, _names(["localhost"]))
    front_proxy = _ensure_ca(pki.front_proxy_ca_cert, pki.front_proxy_ca_key, "tailor-devcluster-front-proxy-ca")
    _ensure_leaf(pki.client_cert(FRONT_PROXY_CLIENT), pki.client_key(FRONT_PROXY_CLIENT), front_proxy,
                 _common_name(FRONT_PROXY_CLIENT), ExtendedKeyUsageOID.CLIENT_AUTH)
    if not (pki.service_account_key.is_file() and pki.service_account_pub.is_file()):
        sa_key = _new_key()
        _write_key(pki.service_account_key, sa_key)
        pki.service_account_pub.write_bytes(sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return pki
