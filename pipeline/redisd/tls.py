"""Redis over TLS: the files a client or server uses, certificates made per run for the
embedded server, and one clear line for each way a TLS connection goes wrong.

``redis.tls=true`` (``redis.tls.enabled``) with no ``redis.url``: the launcher makes a CA,
a server certificate (127.0.0.1 and localhost) and a client certificate in
``RUN_DIR/redis/tls`` (the folder 0700, every file 0600; the CA's key is never written,
so nobody can sign another certificate with it), starts redis-server on TLS only
(``port 0``, ``tls-port`` on loopback, ``tls-auth-clients yes``) and hands the pools
``rediss://`` and the client's files through the environment (``NONSTOP_REDIS_URL``,
``NONSTOP_REDIS_TLS_CA``/``_CERT``/``_KEY``). An operator's Redis: ``redis.url=rediss://...``
with ``redis.tls.ca``/``cert``/``key`` (or those variables; deploy/README.md).
``rediss+sentinel://`` and ``rediss+cluster://`` use the same files for every sentinel
and node; ``redis=ha``/``redis=cluster`` with ``redis.tls=true`` put the local nodes and
sentinels on TLS only with the run's certificates (pipeline/topology/ha.py, cluster.py).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import socket
import ssl
from dataclasses import dataclass, field
from urllib.parse import urlsplit

# the settings and the environment variables that override them (pipeline/config/redis.py, env.py)
KEYS = {"ca": "redis.tls.ca", "cert": "redis.tls.cert", "key": "redis.tls.key"}
ENV = {
    "ca": "NONSTOP_REDIS_TLS_CA",
    "cert": "NONSTOP_REDIS_TLS_CERT",
    "key": "NONSTOP_REDIS_TLS_KEY",
}


@dataclass(frozen=True)
class TLSFiles:
    """PEM files of one side of a TLS connection: the CA that signs the peer's
    certificate, this side's certificate and its key ("" where not given). ``origin``
    names where each came from (a setting or a variable), for error messages."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    origin: dict[str, str] = field(default_factory=dict, compare=False)

    def named(self, what: str) -> str:
        """``redis.tls.ca`` or ``NONSTOP_REDIS_TLS_CA``: where ``what`` was set."""
        return self.origin.get(what, KEYS[what])

    def client_kwargs(self) -> dict[str, str]:
        """redis-py's arguments for a ``rediss://`` connection (without a CA the
        system's trusted CAs check the server)."""
        out = {"ssl_cert_reqs": "required"}
        if self.ca:
            out["ssl_ca_certs"] = self.ca
        if self.cert:
            out["ssl_certfile"], out["ssl_keyfile"] = self.cert, self.key
        return out

    def cli_args(self) -> str:
        """The same for ``redis-cli``: ``--tls --cacert CA --cert CERT --key KEY``."""
        out = "--tls"
        if self.ca:
            out += f" --cacert {self.ca}"
        if self.cert:
            out += f" --cert {self.cert} --key {self.key}"
        return out

    def env(self) -> dict[str, str]:
        """The variables that hand these files to a pool."""
        return {ENV[k]: getattr(self, k) for k in ENV if getattr(self, k)}


TLS_SCHEMES = ("rediss", "rediss+sentinel", "rediss+cluster")


def is_tls(url: str) -> bool:
    """Whether ``url`` speaks TLS: ``rediss://``, ``rediss+sentinel://`` (the sentinels
    and the nodes they name) or ``rediss+cluster://`` (every cluster node)."""
    return url.split("://", 1)[0].lower() in TLS_SCHEMES


# ------------------------------------------------------------- per-run certificates


LOOPBACK = ("127.0.0.1", "localhost")


def write_private(path: str, data: str | bytes) -> str:
    """Write ``data`` to ``path`` readable by its owner only (0600: secrets, URLs with
    passwords, keys); return ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    os.chmod(path, 0o600)  # an older file of the same name keeps its mode otherwise
    return path


def make_run_certs(
    folder: str, hosts: tuple[str, ...] | list[str] = LOOPBACK, days: int = 365
) -> tuple[TLSFiles, TLSFiles]:
    """A fresh CA, a server certificate for ``hosts`` (addresses or names; the embedded
    server's: 127.0.0.1 and localhost) and a client certificate, both signed by it, in
    ``folder`` (made 0700; ca.crt, server.crt/.key, client.crt/.key, each 0600).
    Returns (the server's files, the client's files); both name the CA certificate.
    The CA's private key stays in memory and is dropped: nothing else can be signed."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def build(subject, issuer, public_key, ca: bool):
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name("nonstop-rl run CA")
    ca_cert = (
        build(ca_name, ca_name, ca_key.public_key(), ca=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )

    ca_path = write_private(
        os.path.join(folder, "ca.crt"), ca_cert.public_bytes(serialization.Encoding.PEM)
    )
    aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())

    def leaf(stem: str, cn: str, usage, san: list | None) -> TLSFiles:
        key = ec.generate_private_key(ec.SECP256R1())
        b = build(name(cn), ca_name, key.public_key(), ca=False)
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        b = b.add_extension(aki, critical=False)
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = b.sign(ca_key, hashes.SHA256())
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return TLSFiles(
            ca=ca_path,
            cert=write_private(
                os.path.join(folder, f"{stem}.crt"), cert.public_bytes(serialization.Encoding.PEM)
            ),
            key=write_private(os.path.join(folder, f"{stem}.key"), key_pem),
        )

    san = []
    for h in hosts:
        try:
            san.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            san.append(x509.DNSName(h))
    server = leaf("server", hosts[0], ExtendedKeyUsageOID.SERVER_AUTH, san)
    client = leaf("client", "nonstop-rl client", ExtendedKeyUsageOID.CLIENT_AUTH, None)
    return server, client


# ------------------------------------------------------------- what went wrong, in one line


def speaks_tls(host: str, port: int, timeout_s: float = 3.0) -> bool:
    """Whether ``host:port`` answers a TLS handshake (a server that then refuses our
    missing client certificate counts); False for a plain-text server or none."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        with (
            socket.create_connection((host, port), timeout=timeout_s) as raw,
            ctx.wrap_socket(raw),
        ):
            return True
    except ssl.SSLError as e:  # a TLS alert is a TLS answer; text back is not
        return "WRONG_VERSION_NUMBER" not in str(e) and "record layer" not in str(e)
    except OSError:
        return False


def speaks_plain(host: str, port: int, timeout_s: float = 3.0) -> bool:
    """Whether ``host:port`` answers a plain-text PING the way Redis does (+PONG, or an
    error such as -NOAUTH); False for a TLS server or none."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            s.sendall(b"PING\r\n")
            return s.recv(1)[:1] in (b"+", b"-")
    except OSError:
        return False


VERIFY_FAILED = ("CERTIFICATE_VERIFY_FAILED", "certificate verify failed")
# the server ended the handshake: a missing or unknown client certificate (TLS 1.3
# reports it on the first write as an EOF; TLS 1.2 as an alert)
CLIENT_CERT = (
    "EOF occurred in violation of protocol",
    "CERTIFICATE_REQUIRED",
    "certificate required",
    "UNKNOWN_CA",
    "unknown ca",
    "BAD_CERTIFICATE",
    "bad certificate",
)


def settled(error: BaseException) -> bool:
    """Whether one failure is enough to believe :func:`explain`: a connection closed in
    the handshake may also be a server going down, so that one counts when seen twice."""
    return "EOF occurred in violation of protocol" not in str(error)


def explain(
    url: str, error: BaseException, tls: TLSFiles | None, shown_url: str, scheme: str = "redis"
) -> str | None:
    """One line saying what is wrong with the TLS (or plain-text) connection to ``url``
    (one server: ``redis://`` or ``rediss://``) and how to fix it; None when ``error``
    is not about TLS (the caller may retry it). ``shown_url``: the URL as the message
    shows it (password hidden); ``scheme``: the plain-text scheme the user writes
    (``redis+sentinel``, ``redis+cluster``: a sentinel or cluster node), whose TLS form
    (``rediss+sentinel``) the fixes name."""
    text = str(error)
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 6379
    plain, tls_scheme = scheme, "rediss" + scheme.removeprefix("redis")
    if not is_tls(url):
        closed = any(s in text.lower() for s in ("closed", "reset by peer", "broken pipe"))
        if closed and speaks_tls(host, port):
            return (
                f"redis at {shown_url} speaks TLS: use {tls_scheme}:// in the URL (redis.url or "
                "NONSTOP_REDIS_URL) and redis.tls.ca (NONSTOP_REDIS_TLS_CA) for the CA that "
                "signs its certificate, with redis.tls.cert/key when it asks for a client "
                "certificate"
            )
        return None
    tls = tls or TLSFiles()
    if any(s in text for s in VERIFY_FAILED):
        if "mismatch" in text:
            return (
                f"certificate verify failed: the certificate of redis at {shown_url} is not "
                f"for {host} ({_reason(text)}); use a host name or address it names"
            )
        signer = (
            f"{tls.named('ca')}={tls.ca} does not sign"
            if tls.ca
            else "no redis.tls.ca, and no CA this system trusts signs"
        )
        return (
            f"certificate verify failed: {signer} the certificate of redis at {shown_url} "
            f"({_reason(text)}); set redis.tls.ca (NONSTOP_REDIS_TLS_CA) to the CA that "
            "signed it (an embedded server's: RUN_DIR/redis/tls/ca.crt)"
        )
    if any(s in text for s in CLIENT_CERT) and not speaks_plain(host, port):
        if not tls.cert:
            return (
                f"redis at {shown_url} closed the TLS connection: it asks for a client "
                "certificate; set redis.tls.cert and redis.tls.key (NONSTOP_REDIS_TLS_CERT, "
                "_KEY) to one signed by the CA of its tls-ca-cert-file"
            )
        return (
            f"redis at {shown_url} closed the TLS connection: it refused the client "
            f"certificate {tls.named('cert')}={tls.cert}; give one signed by the CA of "
            "its tls-ca-cert-file"
        )
    plainish = ("WRONG_VERSION_NUMBER", "wrong version number", "record layer", "Timeout")
    if (any(s in text for s in plainish) or isinstance(error, TimeoutError)) and speaks_plain(
        host, port
    ):
        return (
            f"redis at {shown_url} does not speak TLS: use {plain}:// in the URL, or turn on "
            "TLS on the server (tls-port; deploy/redis/nonstop-redis.conf)"
        )
    return None


def _reason(text: str) -> str:
    """OpenSSL's reason in an error's text, without redis-py's wrapping."""
    text = re.sub(r"\s*\(_ssl\.c:\d+\)", "", text)
    for cut in ("certificate verify failed:", "]"):
        if cut in text:
            text = text.rsplit(cut, 1)[1]
    return text.strip(" .") or "no reason given"


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.redisd.tls DIR HOST [HOST ...]``: an operator's CA, server
    and client certificates (deploy/README.md, "Redis over TLS")."""
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m pipeline.redisd.tls",
        description="Make a CA, a server certificate for HOSTs and a client certificate.",
    )
    p.add_argument("dir", help="folder for ca.crt, server.crt/.key, client.crt/.key (0600)")
    p.add_argument("hosts", nargs="+", help="names and addresses clients reach Redis by")
    p.add_argument("--days", type=int, default=365, help="validity (default 365)")
    args = p.parse_args(argv)
    server, client = make_run_certs(args.dir, args.hosts, args.days)
    print(f"CA {server.ca}\nserver {server.cert} {server.key}\nclient {client.cert} {client.key}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
