"""One store_bench phase of aenv's store API, run by whatever ``aenv_store`` is first on
``sys.path`` (store_bench's ``--aenv-tree LABEL=DIR`` runs this script with
``PYTHONPATH=DIR``): so one benchmark run can put another checkout of aenv (the
tree before a change) beside this one and the peers, under the same load.

Each command times itself the way store_bench times its in-process aenv subject
(``Store.open`` to ``close``; interpreter start and imports are not in the number)
and prints one JSON object on stdout. Only the public store API is used, so older
trees work as long as that API does.

    python _aenv_tree.py ingest  DATA_DIR REPO IMAGE NAME   -> {"seconds": s, "mid": hex}
    python _aenv_tree.py restore DATA_DIR REPO MID OUT      -> {"seconds": s}
    python _aenv_tree.py verify  DATA_DIR REPO              -> {"seconds": s, "problems": [...]}
    python _aenv_tree.py version                            -> {"version": "...", "path": "..."}
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

READ_BLOCK = 4 << 20  # store_bench's block size for writes and reads
MEDIA_TYPE = "application/vnd.aenv.disk-layer"


def _import_store() -> None:
    """Import what a phase uses before its clock starts (the in-process subject has it
    imported too): a phase times Store.open to close, not the interpreter's imports."""
    import aenv_store.config  # noqa: F401
    import aenv_store.store  # noqa: F401
    try:
        import aenv_store.export  # noqa: F401
    except ImportError:   # a tree from before aenv_store.export
        pass


def _open(data_dir: str, repo: str, create: bool = False) -> Any:
    from aenv_store.config import RepositoryConfig, StoreConfig, StorePaths, StoreSettings
    from aenv_store.store import Store
    return Store.open(StoreSettings(paths=StorePaths(Path(data_dir)), store=StoreConfig(),
                                    repository=RepositoryConfig(path=repo)), create=create)


def ingest(data_dir: str, repo: str, image: str, name: str) -> dict[str, Any]:
    from aenv_store.formats.catalog import CatalogRecord
    _import_store()
    t0 = time.perf_counter()
    store = _open(data_dir, repo, create=True)
    try:
        with store.workspace() as ws:
            writer = ws.blob_writer(MEDIA_TYPE, size=Path(image).stat().st_size)
            with open(image, "rb") as f:
                while block := f.read(READ_BLOCK):
                    writer.append(block)
            mid = writer.close()
            ws.commit(CatalogRecord(name=name, kind="image", manifests=(("disk", mid),), created=time.time()))
    finally:
        store.close()
    return {"seconds": time.perf_counter() - t0, "mid": bytes(mid).hex()}


def restore(data_dir: str, repo: str, mid_hex: str, out: str) -> dict[str, Any]:
    from aenv_store.formats.ids import Digest
    _import_store()
    t0 = time.perf_counter()
    store = _open(data_dir, repo)
    try:
        reader = store.open_blob(Digest.from_hex(mid_hex))
        try:
            from aenv_store import export
        except ImportError:   # a tree from before aenv_store.export: what restoring meant then
            with open(out, "wb") as f:
                for off in range(0, reader.size, READ_BLOCK):
                    f.write(reader.read(off, READ_BLOCK))
        else:
            if hasattr(export, "write_parts"):
                export.write_parts(reader.read_parts, reader.size, Path(out))
            else:   # a tree from before BlobReader.read_parts
                export.write_file(reader.read, reader.size, Path(out))
    finally:
        store.close()
    return {"seconds": time.perf_counter() - t0}


def verify(data_dir: str, repo: str) -> dict[str, Any]:
    from aenv_store.admin.verify import format_report, verify as run_verify
    _import_store()
    t0 = time.perf_counter()
    store = _open(data_dir, repo)
    try:
        report = run_verify(store.repository, read_data=True)
    finally:
        store.close()
    return {"seconds": time.perf_counter() - t0,
            "problems": [] if report.ok else list(format_report(report, True))}


def version() -> dict[str, Any]:
    import aenv_store
    return {"path": str(Path(aenv_store.__file__).resolve().parent.parent)}


def main(argv: list[str]) -> int:
    commands = {"ingest": ingest, "restore": restore, "verify": verify, "version": version}
    if not argv or argv[0] not in commands:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(commands[argv[0]](*argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
