"""A token service for Docker's bearer-token auth (the role docker_auth or Docker Hub's
auth.docker.io plays), so the real docker-registry can run with ``auth: token``.

It answers ``GET /token?service=…&scope=repository:NAME:ACTIONS`` with a JWT
(RS256, the signing certificate in the ``x5c`` header, which the registry checks
against its ``rootcertbundle``). Basic credentials USER/PASSWORD get pull and
push on every repository; anonymous callers get pull on ``public/*`` only; wrong
credentials get 401. Runs on a thread of the test process, loopback only."""
from __future__ import annotations

import base64
import datetime
import http.server
import json
import secrets
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID

SERVICE = "aenv-test-registry"
ISSUER = "aenv-test-issuer"


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass
class TokenServer:
    user: str
    password: str
    cert_pem: Path
    port: int = 0
    issued: list[str] = field(default_factory=list)      # "user scope" of each token given

    def start(self) -> None:
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "aenv test token signer")])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(key, hashes.SHA256()))
        self.cert_pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self._key = key
        self._x5c = base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                url = urllib.parse.urlsplit(self.path)
                q = urllib.parse.parse_qs(url.query)
                who = server.check(self.headers.get("Authorization"))
                if who is False:
                    self.send_response(401)
                    self.end_headers()
                    return
                body = json.dumps({"token": server.token(who, q.get("scope", []), q.get("service", [""])[0]),
                                   "expires_in": 300}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)

    def check(self, header: str | None) -> str | None | bool:
        """The user name, None for anonymous, False for wrong credentials."""
        if not header:
            return None
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "basic":
            return False
        user, _, password = base64.b64decode(value).decode().partition(":")
        return user if (user, password) == (self.user, self.password) else False

    def token(self, user: str | None, scopes: list[str], service: str) -> str:
        access = []
        for scope in " ".join(scopes).split():
            kind, _, rest = scope.partition(":")
            name, _, actions = rest.rpartition(":")
            allowed = actions.split(",") if user else (["pull"] if name.startswith("public/") else [])
            access.append({"type": kind, "name": name, "actions": [a for a in actions.split(",") if a in allowed]})
        now = int(time.time())
        claims = {"iss": ISSUER, "sub": user or "", "aud": service or SERVICE, "exp": now + 300, "nbf": now - 10,
                  "iat": now, "jti": secrets.token_hex(8), "access": access}
        header = {"typ": "JWT", "alg": "RS256", "x5c": [self._x5c]}
        signing = _b64url(json.dumps(header).encode()) + "." + _b64url(json.dumps(claims).encode())
        sig = self._key.sign(signing.encode(), padding.PKCS1v15(), hashes.SHA256())
        self.issued.append(f"{user or 'anonymous'} {' '.join(scopes)}")
        return signing + "." + _b64url(sig)

    def registry_auth_yaml(self) -> list[str]:
        return ["auth:", "  token:", f"    realm: {self.realm}", f"    service: {SERVICE}",
                f"    issuer: {ISSUER}", f"    rootcertbundle: {self.cert_pem}"]
