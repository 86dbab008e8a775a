"""Templates: a booted guest frozen once, from which sandboxes are restored.

template.py  the template record in the store (find, list, remove, alias, stage a file)
build.py     cold boot + freeze of the guest into a new template
local.py     a node's local files of the templates its sandboxes use
trust.py     the host's CA certificates into a booted guest's trust store ([vm] trust_host_ca)
"""
