"""E2B's wire vocabulary, in one package that imports nothing of the project's.

Sans-IO, as h11 is: pure functions and frozen records over ``str``, ``bytes`` and
JSON values; no sockets, no aiohttp, no asyncio. The node's API (``aenv_api``), the
fleet's gateway (``aenv_fleet``) and the VM layer's template builds (``aenv_vm.builds``)
share these names instead of importing each other's internals:

* ``headers``: every header name the API, the proxy and the gateway speak;
* ``routing``: which requests are sandbox traffic (routing headers, ``<port>-<id>.<domain>``
  hosts, AgentENV's ``/proxy`` prefix, signed file URLs naming no sandbox);
* ``api_key``: how a request presents the deployment's API key;
* ``errors``: E2B's error body (``{"code", "message", "error_code"?}``) and this
  package's own parse errors (``WireError``);
* ``listing``: the times the API shows, the node's page token, the metadata filter,
  ``clientID`` and the fallback ``envdVersion``;
* ``cluster``: the node <-> gateway contract (the ``/_aenv/cluster`` routes and the
  machine-readable codes of their answers);
* ``fleet_auth``: the fleet secret's keys: the node credential a gateway sends with each
  request to a node, and the signature of a node's record in Redis;
* ``builds``: E2B's template build request (``TemplateBuildStartV2``) as a typed ``BuildSpec``;
* ``nodes``: E2B's node admin records (``Node``, ``NodeDetail``, ``NodeStatusChange``),
  one shape for a node's own ``/nodes`` and a fleet gateway's.

tests/test_imports.py keeps this package free of every other project import.
"""
