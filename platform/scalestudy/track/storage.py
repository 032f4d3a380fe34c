"""Where results live: a local folder or any filesystem URI (s3://, gs://, hdfs://, abfs://, or an
fsspec protocol), read and written through one layer.

The results root reaches Ray Train and Tune untouched: a URI is never turned into a local path
(`Path("s3://b/x").resolve()` is `<cwd>/s3:/b/x`), so every node resolves it itself with its own
credentials. The ledger goes through the same layer (Folder: one folder's files, its filesystem
resolved once): a local file is written atomically (temp file in the same folder, fsync, rename, so
a reader never sees half a file and a crash never leaves one); on an object store a file is one
object put, which stores publish atomically.
"""

from __future__ import annotations

import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
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


def split(location: str | Path) -> tuple[Location, str]:
    """(parent, name) of a location; a URI keeps its scheme, host and query."""
    loc = as_location(location)
    if isinstance(loc, Path):
        return loc.parent, loc.name
    parts = urlsplit(loc)
    head, _, name = parts.path.rstrip("/").rpartition("/")
    return urlunsplit((parts.scheme, parts.netloc, head, parts.query, parts.fragment)), name


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
            f.flush()
            os.fsync(f.fileno())  # on disk before it has its name: a crash leaves old or new, whole
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# Parallel reads of many small files on an object store (one request each; latency-bound).
REMOTE_READERS = 16


class Folder:
    """The files directly in one folder, local or under a URI: list, read, write whole.

    A URI's filesystem is resolved once per Folder, not once per file (an S3 filesystem resolves
    its bucket's region when made). Names starting with "." (temp files of a write) are not listed.
    """

    def __init__(self, location: str | Path):
        self.location = as_location(location)
        self._remote = None  # (pyarrow filesystem, path), made on first use
        self._made = False  # the folder made (a filesystem with real folders) by a first write

    def _fs(self):
        if self._remote is None:
            fs, path = filesystem(self.location)
            self._remote = fs, path.rstrip("/")
        return self._remote

    def names(self) -> list[str]:
        """File names in the folder, sorted; [] when there is no such folder."""
        if isinstance(self.location, Path):
            try:
                with os.scandir(self.location) as entries:
                    names = [e.name for e in entries if e.is_file()]
            except FileNotFoundError:
                return []
        else:
            import pyarrow.fs as pafs

            fs, path = self._fs()
            infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
            names = [i.base_name for i in infos if i.type == pafs.FileType.File]
        return sorted(n for n in names if not n.startswith("."))

    def exists(self, name: str) -> bool:
        if isinstance(self.location, Path):
            return (self.location / name).is_file()
        import pyarrow.fs as pafs

        fs, path = self._fs()
        return fs.get_file_info(f"{path}/{name}").type == pafs.FileType.File

    def read(self, name: str) -> bytes:
        if isinstance(self.location, Path):
            return (self.location / name).read_bytes()
        fs, path = self._fs()
        with fs.open_input_stream(f"{path}/{name}") as f:
            return f.read()

    def read_many(self, names: list[str]) -> list[bytes]:
        if isinstance(self.location, Path) or len(names) < 2:
            return [self.read(n) for n in names]
        with ThreadPoolExecutor(min(REMOTE_READERS, len(names))) as pool:
            return list(pool.map(self.read, names))

    def write(self, name: str, data: bytes) -> None:
        """A new or replaced file, whole: readers see the old contents or the new, never a part."""
        if isinstance(self.location, Path):
            _write_local(self.location / name, data)
            return
        fs, path = self._fs()
        if not self._made and fs.type_name not in OBJECT_STORES:  # HDFS, fsspec's need the folder
            fs.create_dir(path, recursive=True)
        self._made = True
        with fs.open_output_stream(f"{path}/{name}") as f:  # one put, published on close
            f.write(data)


def require_local(root: str | Path, field: str, why: str, fix: str) -> Path:
    """The root as a local Path, or a SpecError saying why a URI cannot be used here."""
    loc = as_location(root)
    if not isinstance(loc, Path):
        raise SpecError(field, str(root), f"{why}; {fix}")
    return loc
