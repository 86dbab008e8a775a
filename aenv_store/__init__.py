"""aenv_store: the content-addressed snapshot/image storage engine.

Layers, bottom up: ``formats/`` (codecs of the repository format) ->
``repository/`` (the repository on a backend, locks) -> ``cache/`` (the node
cache) -> ``chunks.py`` (the read chain: node cache -> peers -> repository),
``workspace.py`` (staging and commit) -> ``store.py`` (the Store facade);
``admin/`` (verify, gc) reads the repository layer; ``p2p/`` shares committed
chunks between nodes and ``assembly.py`` puts it into a node's Store.
Nothing here knows about VMs or the API.
"""
