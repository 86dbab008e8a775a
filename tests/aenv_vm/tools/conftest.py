"""Fixtures of the tools tests: a real docker-registry on loopback (tests/aenv_vm/oci's)."""
from tests.aenv_vm.oci.conftest import start_registry  # noqa: F401  (a fixture)
