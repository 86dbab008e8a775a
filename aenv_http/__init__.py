"""HTTP plumbing on aiohttp that the node's API (aenv_api.server) and the fleet's
gateway (aenv_fleet.gateway) both serve with: a runner whose connections answer the
requests aiohttp's parser refuses in E2B's JSON error shape (runner.py), the
WebSocket relay of a proxy hop (wsbridge.py), and what counts as an empty JSON body
(bodies.py). Of the project it imports only aenv_wire (tests/test_imports.py)."""
