"""Volumes: persistent directory trees on the node that outlive sandboxes (E2B's
Volume API). ``tree`` is the symlink-safe access to one tree, ``registry`` the
node's volumes."""
