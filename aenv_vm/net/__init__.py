"""Per-sandbox network namespaces with a tap device (clone-safe networking)."""
