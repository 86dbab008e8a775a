"""aenv_store: the content-addressed snapshot/image storage engine.

Data path: builder workspace (staging) -> repository (packs, index, manifests,
catalog on a backend) -> node cache (bounded local LRU) -> readers.
Nothing here knows about VMs or the API.
"""
