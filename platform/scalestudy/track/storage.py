"""Where results live: a local folder or any filesystem URI (s3://, gs://, hdfs://, abfs://, or an
fsspec protocol), read and written through one layer.

The results root reaches Ray Train and Tune untouched: a URI is never turned into a local path
(`Path("s3://b/x").resolve()` is `<cwd>/s3:/b/x`), so every node resolves it itself with its own
credentials. The ledger goes through the same layer: a local file is replaced atomically (temp file
in the same folder + rename, so a reader never sees half a file); on an object store the whole file
is one object put, which stores publish atomically.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from scalestudy.errors import SpecError

RESULTS_ROOT_ENV = "SCALESTUDY_RESULTS_ROOT"
DEFAULT_RESULTS_ROOT = "results"
# Schemes pyarrow resolves itself (FileSystem.from_uri), so Ray Train can be given the URI as is.
PYARROW_SCHEMES = ("s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss", "file")
# pyarrow filesystems with no real folders: making one would put empty marker objects.
OBJECT_STORES = ("s3", "gcs")

Location = Path | str  # a local path (Path) or a URI (str)


def default_results_root() -> str:
    return os.environ.get(RESULTS_ROOT_ENV) or DEFAULT_RESULTS_ROOT


def is_uri(location: str | Path) -> bool:
    """A URI with a scheme other than file:// (file:// names a local path)."""
    if isinstance(location, Path):
        return False
    scheme = urlsplit(str(location)).scheme
    # One letter is a Windows drive (C:\...), not a scheme.
    return len(scheme) > 1 and scheme != "file"


def as_location(root: str | Path) -> Location:
    """A root as given on the command line -> a Path (local) or the URI string, untouched."""
    text = str(root)
    if is_uri(text):
        return text
    if text.startswith("file://"):
        return Path(urlsplit(text).path)
    return Path(text)


def join(root: str | Path, *parts: str) -> Location:
    """root/part/...; a URI keeps its scheme, host and query (e.g. ?endpoint_override=...)."""
    loc = as_location(root)
    if isinstance(loc, Path):
        return loc.joinpath(*parts)
    split = urlsplit(loc)
    path = "/".join([split.path.rstrip("/"), *(p.strip("/") for p in parts)])
    return urlunsplit((split.scheme, split.netloc, path, split.query, split.fragment))


def absolute(location: str | Path) -> Location:
    """A local path made absolute (a Ray worker's cwd is not the driver's); a URI untouched."""
    loc = as_location(location)
    return loc.resolve() if isinstance(loc, Path) else loc


def filesystem(location: Location):
    """(pyarrow filesystem, path on it) of a URI; an fsspec-only protocol is wrapped for pyarrow."""
    import pyarrow.fs as pafs

    if isinstance(location, Path):
        return pafs.LocalFileSystem(), str(location.absolute())
    if urlsplit(location).scheme in PYARROW_SCHEMES:
        return pafs.FileSystem.from_uri(location)
    import fsspec

    fs, path = fsspec.core.url_to_fs(location)
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


def ray_storage(location: str | Path) -> dict:
    """RunConfig keywords (storage_path, storage_filesystem) for Ray Train and Tune.

    Local: the absolute path. A URI pyarrow knows: the URI itself, so each node resolves it with its
    own credentials. Any other fsspec URI: the wrapped filesystem and its path."""
    loc = as_location(location)
    if isinstance(loc, Path):
        return {"storage_path": str(loc.resolve()), "storage_filesystem": None}
    if urlsplit(loc).scheme in PYARROW_SCHEMES:
        return {"storage_path": loc, "storage_filesystem": None}
    fs, path = filesystem(loc)
    return {"storage_path": path, "storage_filesystem": fs}


def exists(location: Location) -> bool:
    import pyarrow.fs as pafs

    if isinstance(location, Path):
        return location.exists()
    fs, path = filesystem(location)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def read_bytes(location: Location) -> bytes:
    if isinstance(location, Path):
        return location.read_bytes()
    fs, path = filesystem(location)
    with fs.open_input_stream(path) as f:
        return f.read()


def write_bytes(location: Location, data: bytes) -> None:
    """Replace the file whole: readers see the old contents or the new, never a part."""
    if isinstance(location, Path):
        _write_local(location, data)
        return
    fs, path = filesystem(location)
    parent = path.rsplit("/", 1)[0]
    if fs.type_name not in OBJECT_STORES and parent and parent != path:
        fs.create_dir(parent, recursive=True)  # HDFS, fsspec's filesystems need the folder
    with fs.open_output_stream(path) as f:  # one write, published by the store on close
        f.write(data)


def _write_local(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def require_local(root: str | Path, field: str, why: str, fix: str) -> Path:
    """The root as a local Path, or a SpecError saying why a URI cannot be used here."""
    loc = as_location(root)
    if not isinstance(loc, Path):
        raise SpecError(field, str(root), f"{why}; {fix}")
    return loc
