"""envd: the in-sandbox daemon speaking E2B's envd protocol (stdlib only)."""

# The upstream envd feature level served here: what the control plane reports
# as a sandbox's ``envdVersion`` (the SDK gates features on it: octet-stream
# uploads 0.5.7, file metadata 0.6.2, watch entries 0.6.3, network mounts 0.6.4).
ENVD_VERSION = "0.6.4"
# The port envd listens on in every sandbox (E2B's). The one definition in the
# project: the host side imports it from here (this module is plain constants).
ENVD_PORT = 49983
# ``GET /health`` answers with this header naming ENVD_VERSION, so the host can
# record the version a template's guest really runs (aenv_vm/templates/base.py).
VERSION_HEADER = "X-Envd-Version"
