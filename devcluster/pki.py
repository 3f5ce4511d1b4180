"""The devcluster's certificate authority, serving and client certificates, and service-account keys.

Identities follow what kubeadm issues, so RBAC sees the same users a real cluster has: the admin is
in `system:masters`, the controller manager and scheduler use their `system:kube-*` users and rely on
the bootstrap ClusterRoleBindings for them.
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
)


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

    def client_cert(self, stem: str) -> Path:
        return self.root / f"{stem}.crt"

    def client_key(self, stem: str) -> Path:
        return self.root / f"{stem}.key"


def ensure_pki(root: Path) -> Pki:
    """Create the CA and every certificate under `root` unless a complete set is already there."""
    pki = Pki(root)
    if (root / "complete").exists():
        return pki
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)

    ca_key = _new_key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tailor-devcluster-ca")])
    ca = _sign(ca_name, ca_key, ca_name, ca_key, [
        (x509.BasicConstraints(ca=True, path_length=None), True),
        (x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                       key_encipherment=False, data_encipherment=False, key_agreement=False,
                       encipher_only=False, decipher_only=False), True),
    ])
    _write_key(pki.ca_key, ca_key)
    _write_cert(pki.ca_cert, ca)

    def leaf(subject: x509.Name, usage: x509.ObjectIdentifier,
             more: list[tuple[x509.ExtensionType, bool]]) -> tuple[rsa.RSAPrivateKey, x509.Certificate]:
        key = _new_key()
        return key, _sign(subject, key, ca_name, ca_key, [
            (x509.BasicConstraints(ca=False, path_length=None), True),
            (x509.ExtendedKeyUsage([usage]), False),
            *more,
        ])

    sans = x509.SubjectAlternativeName([
        x509.DNSName("localhost"), x509.DNSName("kubernetes"), x509.DNSName("kubernetes.default"),
        x509.DNSName("kubernetes.default.svc"), x509.DNSName("kubernetes.default.svc.cluster.local"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.IPAddress(ipaddress.ip_address(SERVICE_IP)),
    ])
    key, cert = leaf(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]),
                     ExtendedKeyUsageOID.SERVER_AUTH, [(sans, False)])
    _write_key(pki.serving_key, key)
    _write_cert(pki.serving_cert, cert)

    for client in CLIENTS:
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, client.user)]
                            + [x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in client.groups])
        key, cert = leaf(subject, ExtendedKeyUsageOID.CLIENT_AUTH, [])
        _write_key(pki.client_key(client.file_stem), key)
        _write_cert(pki.client_cert(client.file_stem), cert)

    sa_key = _new_key()
    _write_key(pki.service_account_key, sa_key)
    pki.service_account_pub.write_bytes(sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    (root / "complete").touch()
    return pki
