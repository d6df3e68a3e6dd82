"""TLS for the job's etcd: a certificate authority per job run, a certificate per member, one for clients.

    ca = ensure_ca(directory)                         # ca.crt, ca.key (made once; the first member rank)
    member = issue(directory, "etcd-0", ca, ips=["10.77.0.1"])   # server and peer certificate
    client = issue(directory, "client", ca)           # what every rank's EtcdClient presents

On a shared cluster any user can reach a TCP port: without this, anyone could write the election key or the
fleet state. Members require client certificates (`--client-cert-auth`, `--peer-client-cert-auth`) signed
by the job's CA, whose key stays in the job directory (mode 0600, like the CURVE keys). The `openssl`
command line makes them (present wherever etcd is); ECDSA P-256, valid 30 days (a job's run is shorter).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

DAYS = "30"


class TlsError(Exception):
    pass


@dataclass(frozen=True)
class TlsFiles:
    ca: str     # the CA certificate clients and members trust
    cert: str   # this party's certificate
    key: str    # and its private key (0600)


def _openssl(*args: str) -> None:
    try:
        result = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=60)
    except FileNotFoundError as exc:
        raise TlsError("no `openssl` command: it makes the job's etcd certificates (Debian package openssl)") from exc
    if result.returncode != 0:
        raise TlsError(f"openssl {args[0]} failed: {result.stderr.strip()[-500:]}")


def _private(path: Path) -> None:
    os.chmod(path, 0o600)


def ensure_ca(directory: Path) -> tuple[Path, Path]:
    """The job's CA (certificate, key), made once in `directory`; atomic, so ranks that race see a whole one."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    cert, key = directory / "ca.crt", directory / "ca.key"
    if cert.exists() and key.exists():
        return cert, key
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        tkey, tcert = Path(tmp) / "ca.key", Path(tmp) / "ca.crt"
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-days", DAYS, "-subj", "/CN=exaserve-job-etcd-ca", "-keyout", str(tkey), "-out", str(tcert))
        _private(tkey)
        os.replace(tkey, key)
        os.replace(tcert, cert)  # last: a reader that sees the certificate finds the key too
    return cert, key


def issue(directory: Path, name: str, ca: tuple[Path, Path], ips: Optional[list[str]] = None) -> TlsFiles:
    """A certificate for `name`, signed by the CA: with `ips`, valid for those addresses (a member: server and
    peer); without, a client's. Both usages are allowed: a member is also its peers' client."""
    cert, key, request = directory / f"{name}.crt", directory / f"{name}.key", directory / f"{name}.csr"
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(request))
    _private(key)
    extensions = directory / f"{name}.ext"
    lines = ["basicConstraints=CA:FALSE", "keyUsage=digitalSignature,keyEncipherment",
             "extendedKeyUsage=serverAuth,clientAuth"]
    if ips:
        lines.append("subjectAltName=" + ",".join(f"IP:{ip.strip('[]')}" for ip in ips))
    extensions.write_text("\n".join(lines) + "\n")
    # a random serial: member ranks on several nodes sign at once, so no shared serial file
    _openssl("x509", "-req", "-in", str(request), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
             "-set_serial", f"0x{secrets.token_hex(16)}", "-days", DAYS, "-extfile", str(extensions),
             "-out", str(cert))
    request.unlink(missing_ok=True)
    extensions.unlink(missing_ok=True)
    return TlsFiles(ca=str(ca[0]), cert=str(cert), key=str(key))
