"""The repository format as pure codecs: ids (BLAKE3), chunking, packs, index
files, manifests and catalog records. Bytes in, records out; no I/O besides
what a caller hands in (docs/store-format.md)."""
