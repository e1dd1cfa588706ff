"""The file operations the host asks for on the agent's files: write, read (whole or a line
range), stat, a folder listing, tar in and out. The server runs them with the agent's
file-system uid (``privileges.agent_fs``), so they have exactly the agent's rights; FIFOs and
devices are refused without blocking, and every answer is bounded."""

import errno
import os
import shutil
import stat as stat_module
import tarfile

MAX_TREE_ENTRIES = 5000
"""A directory view lists at most this many paths (the reply stays small)."""
MAX_TREE_BYTES = 256 * 1024
"""A folder listing stops here too: the reply header is one line the host reads bounded."""
MAX_SCAN_BYTES = 1 << 30
"""A line-range read scans at most this much of a file (any real file on the tmpfs fits)."""


def write_file(req: dict, data: bytes) -> dict:
    """Write ``data`` to ``path`` (parents made; ``mode`` for a new file); a FIFO or device
    there is refused."""
    path = req["path"]
    existed = os.path.exists(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    # O_NONBLOCK: a FIFO put where a file was expected fails at once instead of blocking.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK, 0o600)
    with os.fdopen(fd, "wb") as f:
        if not stat_module.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"not a regular file: {path}")
        f.write(data)
    if not existed:
        os.chmod(path, int(req.get("mode", 0o644)))
    return {}


def open_regular(path: str) -> int:
    """A read descriptor of a regular file; FIFOs and devices are refused without blocking."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat_module.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"not a regular file: {path}")
    return fd


def read_file(req: dict) -> tuple[dict, bytes]:
    """At most ``limit`` bytes of a regular file (all of it without a limit)."""
    fd = open_regular(req["path"])
    limit = req.get("limit")
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        data = f.read() if limit is None else f.read(int(limit))
    return {"size": size}, data


def read_lines(req: dict) -> tuple[dict, bytes]:
    """Lines ``first``..``last`` (1-based, ``last`` -1 = to the end; lines as
    ``split("\\n")`` makes them, each with its newline) of a regular file, at most ``limit``
    bytes, and the file's line count. The file is streamed: only the selection is kept."""
    first, last, limit = int(req["first"]), int(req["last"]), int(req["limit"])
    fd = open_regular(req["path"])
    out, line, truncated, scanned = bytearray(), 1, False, 0
    with os.fdopen(fd, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 16), b""):
            scanned += len(chunk)
            if scanned > MAX_SCAN_BYTES:  # a sparse 1 TB file would keep the shell busy
                raise OSError(errno.EFBIG, f"more than {MAX_SCAN_BYTES} bytes to scan by line")
            newlines = chunk.count(b"\n")
            if line + newlines < first or (last != -1 and line > last):
                line += newlines  # nothing selected in this chunk: count it and move on
                continue
            start = 0
            while True:
                newline = chunk.find(b"\n", start)
                end = len(chunk) if newline < 0 else newline + 1
                if line >= first and (last == -1 or line <= last):
                    piece, room = chunk[start:end], max(limit - len(out), 0)
                    out += piece[:room]
                    truncated = truncated or len(piece) > room
                if newline < 0:
                    break
                line, start = line + 1, newline + 1
    return {"n_lines": line, "truncated": truncated}, bytes(out)


def untar(req: dict, data: bytes) -> dict:
    """Extract regular files and directories only; reject absolute paths and ``..``."""
    import io

    dest = req["dest"]
    if req.get("replace"):
        shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            if member.name.startswith("/") or ".." in parts:
                raise ValueError(f"unsafe path in archive: {member.name!r}")
            target = os.path.join(dest, *[p for p in parts if p not in ("", ".")])
            if member.isdir():
                os.makedirs(target, exist_ok=True)
            elif member.isfile():
                os.makedirs(os.path.dirname(target), exist_ok=True)
                src = tar.extractfile(member)
                assert src is not None  # a regular file member always has data
                with open(target, "wb") as f:
                    shutil.copyfileobj(src, f)
                os.chmod(target, member.mode & 0o777)
    return {}


def make_tar(req: dict) -> tuple[dict, bytes]:
    """The folder ``src`` as an uncompressed tar."""
    import io

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(req["src"], arcname=".")
    return {}, buf.getvalue()


def stat(req: dict) -> dict:
    """Whether ``path`` exists, its kind (:data:`_KINDS`) and size; links are followed."""
    path = req["path"]
    try:
        st = os.stat(path)
    except OSError:
        return {"exists": False, "is_dir": False, "kind": "missing", "size": 0}
    mode = st.st_mode
    kind = next((k for k, test in _KINDS if test(mode)), "other")
    return {"exists": True, "is_dir": kind == "dir", "kind": kind, "size": st.st_size}


_KINDS = (
    ("file", stat_module.S_ISREG),
    ("dir", stat_module.S_ISDIR),
    ("fifo", stat_module.S_ISFIFO),
    ("character device", stat_module.S_ISCHR),
    ("block device", stat_module.S_ISBLK),
    ("socket", stat_module.S_ISSOCK),
)


def list_tree(req: dict) -> dict:
    """Paths up to ``depth`` levels below ``path``, hidden entries (and their contents) skipped."""
    root, depth = req["path"], int(req.get("depth", 2))
    found, size = [root], [len(root)]

    def walk(path: str, level: int) -> None:
        if level > depth:
            return
        try:
            names = sorted(os.listdir(path))
        except OSError:
            return
        for name in names:
            if name.startswith("."):
                continue
            if len(found) >= MAX_TREE_ENTRIES or size[0] >= MAX_TREE_BYTES:
                return
            full = os.path.join(path, name)
            found.append(full)
            size[0] += len(full) + 1
            if os.path.isdir(full) and not os.path.islink(full):
                walk(full, level + 1)

    walk(root, 1)
    return {"paths": found}


AGENT_FILE_OPS = {
    "write": lambda req, payload: (write_file(req, payload), b""),
    "read": lambda req, payload: read_file(req),
    "lines": lambda req, payload: read_lines(req),
    "untar": lambda req, payload: (untar(req, payload), b""),
    "tar": lambda req, payload: make_tar(req),
    "stat": lambda req, payload: (stat(req), b""),
    "tree": lambda req, payload: (list_tree(req), b""),
}
"""Operations on the agent's files; they run with the agent's file-system uid."""
