"""Every header name aenv's API, its sandbox proxy and the fleet's gateway speak.

HTTP header names are case-insensitive; these are the spellings aenv sends.
"""
from __future__ import annotations

# Sandbox traffic: which sandbox, which of its ports (E2B's proxy)
SANDBOX_ID_HEADER = "E2b-Sandbox-Id"
SANDBOX_PORT_HEADER = "E2b-Sandbox-Port"
# AgentENV's routing headers, accepted as E2B's are (its own clients send them); its
# create answer names the new sandbox in the first
AGENTENV_ID_HEADER = "X-Agentenv-Sandbox-Id"
AGENTENV_PORT_HEADER = "X-Agentenv-Target-Port"

# Credentials: the deployment's API key (control plane), a sandbox's envd access token
# (its envd port), its traffic access token (its other ports, allowPublicTraffic: false)
API_KEY_HEADER = "X-API-Key"
AUTHORIZATION_HEADER = "Authorization"
ACCESS_TOKEN_HEADER = "X-Access-Token"
# the node's admin credential (team management, E2B's AdminApiKeyAuth) and the team an admin call acts for
ADMIN_TOKEN_HEADER = "X-Admin-Token"
TEAM_ID_HEADER = "X-Team-ID"
TRAFFIC_TOKEN_HEADER = "e2b-traffic-access-token"

# Lists: the next page's token and the count of running sandboxes
NEXT_TOKEN_HEADER = "X-Next-Token"
TOTAL_RUNNING_HEADER = "X-Total-Running"

REQUEST_ID_HEADER = "X-Request-Id"
# "false": the SDK does not retry this 429/502/503/504
SHOULD_RETRY_HEADER = "Should-Retry"
# whole seconds to wait before retrying a 429 (the SDK waits that long before its retry)
RETRY_AFTER_HEADER = "Retry-After"
