"""aenv_cli: the composition root. The `aenv` command line (thin shells over library
calls), the typed config that composes every package's section (config.py), and the
assembly of one node (node.py) and one gateway (gateway.py). The only package that
imports both aenv_api and aenv_fleet; no project package imports it."""
