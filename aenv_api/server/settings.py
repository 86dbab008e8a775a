"""The ``[server]`` section of aenv's TOML config (see docs/config.md)."""
from __future__ import annotations

from dataclasses import dataclass

from aenv_store.errors import ConfigError


@dataclass(frozen=True)
class ServerConfig:
    # Address the API and the sandbox proxy listen on (flags --host/--port override).
    host: str = "127.0.0.1"
    port: int = 8000
    # Host-routed sandbox traffic: requests for "<port>-<sandboxID>.<domain>" go to that
    # sandbox port. Empty: only header routing (E2b-Sandbox-Id / E2b-Sandbox-Port).
    domain: str = ""
    # Domain a volume's answer names (VolumeAndToken.domain): the SDK then sends volume
    # content requests to https://api.<volume_domain>. Empty (the default): no domain is
    # answered and the SDK uses E2B_VOLUME_API_URL, which the server prints at start.
    volume_domain: str = ""
    # TLS: with a certificate (chain) and its key, PEM files, the server also listens with
    # HTTPS on tls_port (API and proxy alike), so "https://<port>-<id>.<domain>" -- what
    # the SDK's get_host(port) names -- is served once DNS points *.<domain> at the node
    # (a wildcard certificate for *.<domain>). Both or neither; tls_port 0 = any free port.
    tls_cert: str = ""
    tls_key: str = ""
    tls_port: int = 443
    # E2B SDKs before 2.7 ignore E2B_SANDBOX_URL: they reach a sandbox's envd at
    # https://49983-<id>.<domain> (wildcard DNS and TLS: tls_cert above), or, with
    # E2B_DEBUG=true, at http://localhost:49983 for every sandbox. A port here (49983 for
    # those SDKs) makes the node also listen on 127.0.0.1 at it for sandbox traffic only,
    # each request going to the sandbox whose envd access token it carries (a routing
    # header or a signed URL works too). 0 (the default): no such listener.
    envd_debug_port: int = 0
    # Template a request's "base" resolves to, and the alias the first start builds.
    default_template: str = "base"
    # Build the default template at start when the store has none (a cold boot, ~30 s under TCG).
    build_template: bool = True
    # Build E2B's code-interpreter template ("code-interpreter-v1", codeint/) in the
    # background at start when it is missing or made from other sources (a few minutes
    # under TCG, once; aenv_cli/codeint_template.py). Off: build it by hand, or not at all.
    code_interpreter: bool = True
    # Sandbox time to live when create does not say, and the largest accepted (seconds).
    default_timeout: int = 300
    max_timeout: int = 86400
    # Most sandboxes (running + paused) this node holds; create answers 429 beyond it.
    max_sandboxes: int = 64
    # Most children of one fork request (E2B's API: 100; AgentENV's: 16). The node restores
    # them through its admission gate ([vm] restore_slots); children beyond its room or its
    # restore queue fail alone, 429 each in the answer's list.
    max_forks: int = 100
    # Log format of the server's request log on stderr: "text" or "json" (JSON lines).
    log_format: str = "text"
    # What a shutdown does with running sandboxes: "pause" (they come back paused on the
    # next start, as AgentENV does) or "kill".
    on_shutdown: str = "pause"
    # Seconds the shutdown waits for in-flight requests before closing them.
    shutdown_grace: float = 5.0
    # File holding the secret envd access tokens are derived from (HMAC-SHA256 of the
    # sandbox id); generated on first start, mode 0600. "" = <data-dir>/envd-secret; a
    # relative path is relative to the data dir.
    # The AENV_ENVD_SECRET environment variable, when set, is the secret itself (read
    # once at start, then removed from the node's environment; files are preferred).
    envd_secret_file: str = ""
    # File holding the API key (X-API-KEY); generated on first start, mode 0600. "" =
    # <data-dir>/api-key; a relative path is relative to the data dir. AENV_API_KEY, when
    # set, is the key itself (read once, then removed from the environment).
    api_key_file: str = ""
    # File holding the admin credential (X-Admin-Token: creates and deletes teams and their
    # API keys, docs/api.md "Teams and API keys"); "" = none, and the admin routes answer 403
    # unless AENV_ADMIN_TOKEN is set (read once, then removed from the environment). A
    # relative path is relative to the data dir. Never the credential itself in the config.
    teams_admin_token_file: str = ""
    # File holding the key that encrypts the teams' secrets at rest (E2B's /secrets, AES-256-GCM,
    # docs/api.md "Secrets"): 32 random bytes as 64 hex digits (`openssl rand -hex 32`). "" =
    # none, and the secret routes answer 503 unless AENV_SECRETS_KEY is set (read once, then
    # removed from the environment). A relative path is relative to the data dir. Never the key
    # itself in the config; never generated (a lost key loses the secrets, not more).
    secrets_key_file: str = ""
    # Seconds between two samples of each team's running sandboxes and starts, what E2B's
    # GET /teams/{teamID}/metrics answers (aenv_api/server/team_metrics.py; kept in memory,
    # the newest 8640 samples a team).
    team_metrics_interval: float = 5.0

    # The most one sandbox's log (lifecycle events and its captured console lines, GET
    # /sandboxes/{id}/logs) keeps, in MiB: two files of half this each, the oldest
    # entries dropped first (aenv_api/server/sandbox_logs.py). 8 MiB is ~60,000 console
    # lines; a guest printing without end keeps only its newest ones.
    sandbox_log_mib: int = 8

    # The sandbox proxy's bounds (docs/security.md, "What a guest can feed the node").
    # Seconds the proxy waits for a guest's response head (or WebSocket handshake answer)
    # once the request is sent, and while the guest takes none of its body: then 504. Long
    # enough for a guest app that thinks before it answers (a model call); what it bounds is
    # how long a guest that never answers holds a connection.
    proxy_head_timeout: float = 300.0
    # Proxied requests and WebSocket sessions one sandbox may have open at once; beyond, 429.
    # Above what one E2B SDK client opens to a sandbox (200 connections) with room for more.
    proxy_max_connections: int = 512
    # Largest WebSocket message relayed either way (client and guest), compressed ones
    # bounded as they inflate (deflate bombs); beyond it the session is closed with 1009.
    websocket_max_message: int = 16 << 20

    def __post_init__(self) -> None:
        if not 1 <= self.sandbox_log_mib <= 4096:
            raise ConfigError(f"server.sandbox_log_mib must be in 1..4096, got {self.sandbox_log_mib}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"server.port must be in 0..65535, got {self.port}")
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"server.log_format must be text or json, got {self.log_format!r}")
        if not 0 <= self.default_timeout <= self.max_timeout:
            raise ConfigError("server.default_timeout must be in 0..server.max_timeout")
        if self.max_sandboxes < 1 or not 1 <= self.max_forks <= 100:
            raise ConfigError("server.max_sandboxes must be >= 1 and server.max_forks in 1..100")
        if self.on_shutdown not in ("pause", "kill"):
            raise ConfigError(f"server.on_shutdown must be pause or kill, got {self.on_shutdown!r}")
        if self.shutdown_grace < 0:
            raise ConfigError("server.shutdown_grace must be >= 0")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("server.tls_cert and server.tls_key go together: set both or neither")
        if not 0 <= self.envd_debug_port <= 65535:
            raise ConfigError(f"server.envd_debug_port must be in 0..65535, got {self.envd_debug_port}")
        if not 0 <= self.tls_port <= 65535:
            raise ConfigError(f"server.tls_port must be in 0..65535, got {self.tls_port}")
        if self.volume_domain.startswith(".") or "/" in self.volume_domain:
            raise ConfigError(f"server.volume_domain must be a bare domain name, got {self.volume_domain!r}")
        if self.domain.startswith(".") or "/" in self.domain:
            raise ConfigError(f"server.domain must be a bare domain name, got {self.domain!r}")
        if not 0.05 <= self.team_metrics_interval <= 3600:
            raise ConfigError(f"server.team_metrics_interval must be in 0.05..3600 seconds, "
                              f"got {self.team_metrics_interval}")
        if not 0 < self.proxy_head_timeout <= 86400:
            raise ConfigError(f"server.proxy_head_timeout must be in (0, 86400] seconds, got {self.proxy_head_timeout}")
        if not 1 <= self.proxy_max_connections <= 1_000_000:
            raise ConfigError(f"server.proxy_max_connections must be in 1..1000000, got {self.proxy_max_connections}")
        if not 1024 <= self.websocket_max_message <= 1 << 30:
            raise ConfigError(f"server.websocket_max_message must be in 1024..1073741824 bytes, "
                              f"got {self.websocket_max_message}")
