"""Small servers run inside a guest by tests: an HTTP server on port 8080 that echoes the
request headers (JSON), streams SSE on /sse and answers one WebSocket message with
"echo:<message>" (written with the stdlib only: the guest has no websocket library)."""

GUEST_SERVER = r"""
import base64, hashlib, http.server, json, socketserver, struct, time
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        if self.path == "/sse":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            for i in range(3):
                self.wfile.write(f"data: {i}\n\n".encode()); self.wfile.flush(); time.sleep(0.7)
            self.close_connection = True
            return
        if self.headers.get("Upgrade", "").lower() == "websocket":
            key = self.headers["Sec-WebSocket-Key"]
            accept = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest())
            self.send_response(101)
            self.send_header("Upgrade", "websocket"); self.send_header("Connection", "Upgrade")
            self.send_header("Sec-WebSocket-Accept", accept.decode()); self.end_headers(); self.wfile.flush()
            b0, b1 = self.rfile.read(2)
            n = b1 & 0x7f
            if n == 126: n = struct.unpack(">H", self.rfile.read(2))[0]
            mask = self.rfile.read(4)
            data = bytes(c ^ mask[i % 4] for i, c in enumerate(self.rfile.read(n)))
            reply = b"echo:" + data
            self.wfile.write(bytes([0x81, len(reply)]) + reply); self.wfile.flush()
            self.close_connection = True
            return
        b = json.dumps(dict(self.headers)).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(b))); self.end_headers()
        self.wfile.write(b)
class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
S(("0.0.0.0", 8080), H).serve_forever()
"""
