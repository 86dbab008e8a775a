"""Templates: a booted guest frozen once, from which sandboxes are restored.

template.py  the template record in the store (find, list, remove, alias, stage a file; the
             build settings a cold boot needs, with the one fallback for old records)
meta.py      TemplateMeta: every key of a template record's meta, typed (docs/templates.md)
freeze.py    freeze: a stopped guest's disk, memory and device state committed as a record
base.py      the base template: the guest booted once (aenv_vm/machine) and frozen
local.py     a node's local files of the templates its sandboxes use
trust.py     the host's CA certificates into a booted guest's trust store ([vm] trust_host_ca)
"""
