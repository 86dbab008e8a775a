"""Fixtures of the tools tests: a real docker-registry on loopback (tests/oci's)."""
from ..oci.conftest import start_registry  # noqa: F401  (a fixture)
