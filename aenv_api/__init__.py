"""aenv_api: the E2B-compatible control plane, envd proxy, auth and Dockerfile builds."""
