"""The secrets test's host on the sealed test network (run inside the "internet"
namespace the test made), 192.0.2.10:

    python -m tests.aenv_vm.isolation.secrethost CERT_AND_KEY LOG

HTTP on port 80 and HTTPS on 443 (CERT_AND_KEY: a PEM chain and key from the test's
own CA, for secret.test and unruled.test). Every request head it receives is appended
to LOG as one JSON line ``{"port": 80|443, "head": "..."}``; every request is answered
``ok`` (never an echo: what the server got must not flow back into the guest).
``ready`` is printed once both listen."""
from __future__ import annotations

import asyncio
import json
import ssl
import sys

ADDRESS = "192.0.2.10"
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n"


def main(cert: str, log_path: str) -> None:
    log = open(log_path, "a", buffering=1)

    def handler(port: int):  # type: ignore[no-untyped-def]  # a closure factory, as hosts.py
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
                log.write(json.dumps({"port": port, "head": head.decode("latin-1")}) + "\n")
                writer.write(ANSWER)
                await writer.drain()
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError,
                    ssl.SSLError):
                pass
            finally:
                writer.close()
        return handle

    async def run() -> None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert)
        await asyncio.start_server(handler(80), ADDRESS, 80)
        await asyncio.start_server(handler(443), ADDRESS, 443, ssl=ctx)
        print("ready", flush=True)
        await asyncio.Event().wait()

    asyncio.run(run())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
