"""TLS certificates for a parameter-server job across machines, made by its launchers.

Every task of the job is launched on its own machine, by its own ``loom run``, and the job
shares one secret: its token. Each launcher derives the job's certificate authority from
the token (the same key on every machine, nothing to copy), and signs a certificate for its
own task, naming its host. Servers and workers then speak TLS with mutual authentication:
each side presents a certificate that the job's authority signed. A process without the
token can neither read the traffic nor pose as a server; one with it is a member of the job
anyway. Clusters that manage their own certificates set ``LOOM_PS_TLS_CA``,
``LOOM_PS_TLS_CERT`` and ``LOOM_PS_TLS_KEY`` instead (``transport.TLS``).
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from loom.strategies.parameter_server.transport import CA_ENV, CERT_ENV, KEY_ENV

ISSUED = datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc)  # fixed: every machine makes the same authority
EXPIRES = datetime.datetime(2100, 1, 1, tzinfo=datetime.timezone.utc)
TASK_DAYS = 3650


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine's loopback (an address, or ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def job_authority(token: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """The job's certificate authority: its key derived from the token, its certificate the same on every machine."""
    secret = HKDF(algorithm=hashes.SHA256(), length=48, salt=b"loom parameter-server job authority", info=b"P-256").derive(token.encode())
    order = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551  # of P-256
    key = ec.derive_private_key(int.from_bytes(secret, "big") % (order - 1) + 1, ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "loom parameter-server job")])
    serial = int.from_bytes(hashlib.sha256(key.public_key().public_bytes(serialization.Encoding.X962, serialization.PublicFormat.CompressedPoint)).digest()[:16], "big")
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(serial).not_valid_before(ISSUED).not_valid_after(EXPIRES)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    return key, certificate


def task_certificate(token: str, host: str, directory: Path) -> dict[str, str]:
    """Write the job's authority and a certificate for a task on ``host`` (with its key, readable by
    this user only) under ``directory``; the variables that point a server or worker at them."""
    authority_key, authority = job_authority(token)
    key = ec.generate_private_key(ec.SECP256R1())
    where = x509.IPAddress(ipaddress.ip_address(host.strip("[]"))) if _is_address(host) else x509.DNSName(host)
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])).issuer_name(authority.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=TASK_DAYS))
        .add_extension(x509.SubjectAlternativeName([where]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(authority_key, hashes.SHA256())
    )  # fmt: skip
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    paths = {CA_ENV: directory / "job-ca.pem", CERT_ENV: directory / "task.pem", KEY_ENV: directory / "task.key"}
    paths[CA_ENV].write_bytes(authority.public_bytes(serialization.Encoding.PEM))
    paths[CERT_ENV].write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    opener = lambda path, flags: os.open(path, flags, 0o600)  # noqa: E731 - the key is never readable by others, not even briefly
    with open(paths[KEY_ENV], "wb", opener=opener) as file:
        file.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return {variable: str(path) for variable, path in paths.items()}


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False
