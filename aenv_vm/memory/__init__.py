"""Guest memory of a sandbox on the host: memory images and deltas
(memory_image.py, format in docs/snapshots.md), the pages a copy-on-write
QEMU holds privately (pagemap.py) and device-state files (device_state.py)."""
