"""Repository backends: bytes by key (posix_fs, oss), retries as a wrapper.
See base.Backend for the contract."""
