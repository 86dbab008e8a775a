"""OCI images into aenv block images: image references, a registry client (Docker
Registry HTTP API v2 / OCI distribution), layer flattening, image archives, and the
pull that turns an image into an ext4 disk layer in the store (docs/images.md)."""
