"""Grading inside the sandbox, out of the agent's reach (``op: grade`` of the supervisor).

Part of the supervisor's folder, imported by its server on the first submit; like the rest
of it, standard library only. One request does all of it, so submit costs one round trip:

1. Unless the task lets its tests see the agent's processes, every process of the agent's uid
   is killed (stopped ones too) and checked gone, its SysV IPC objects are removed, and
   ``/tmp``, ``/dev/shm`` and ``/dev/mqueue`` are wiped: from here on nothing of the agent
   can act. The workspace is then made plain in place: symbolic links, FIFOs, sockets and
   devices are removed (and reported), hard links are broken, every file and folder is
   handed to the grader's uid. When the agent's processes stay alive (task option), the
   workspace is instead copied as plain files, with the agent's own rights, into
   ``/grade/workspace`` and the tests run there.
2. ``/grade`` (a tmpfs only root can write) gets the tests (owned by root, read-only to the
   tests), the answer (written here, from the submitted text), and a home, a temp folder
   and a result folder owned by the grader's uid.
3. The test command runs as the grader's uid with a fixed environment: its own ``HOME`` and
   ``TMPDIR``, no user site (``PYTHONNOUSERSITE``), no current folder on ``sys.path``
   (``PYTHONSAFEPATH``), nothing inherited from the agent's shell.
   Optional first phase (task option ``subject_command``): the agent's code is run as the
   agent's uid, with no secret in reach, writing what it produces into ``$SUBJECT_OUT``;
   then every agent process is killed again and that folder is made plain and read-only,
   so tests that judge those outputs never run the agent's code with the tests' rights.
4. The grader's processes are killed, then the result file is read (no links followed, size
   capped) and returned raw: the host parses it with the task's declared result format.
"""

import contextlib
import os
import shutil
import stat
import tarfile
import time

from .privileges import AGENT_UID, GRADER_UID, agent_fs
from .reset import kill_uid, remove_ipc, wipe
from .run import exec_reply, spawn
from .state import BASE_ENV, WORKSPACE

GRADE = "/grade"
TESTS = GRADE + "/tests"
ANSWER = GRADE + "/answer"
RESULT = GRADE + "/out/result.json"
SUBJECT_OUT = GRADE + "/subject"
MAX_RESULT_BYTES = 64 * 1024
MAX_REFUSED_SHOWN = 50
"""Names of refused workspace entries returned (the reply header is one line the host reads
bounded: 30,000 refused links used to overflow it and kill the episode as infra)."""
MAX_COPY_BYTES = 512 * 1024 * 1024
"""Plain copy of a live agent's workspace (task option) stops at this many bytes."""


def grade(req: dict, payload: bytes) -> tuple[dict, bytes]:
    """Run the tests as described in the module docstring; reply like ``exec`` plus the
    raw result file (``result``), what was refused from the workspace, and how the agent's
    processes were stopped."""
    answer_len = int(req["answer_len"])
    answer, tests_tar = payload[:answer_len], payload[answer_len:]
    keep = bool(req.get("keep_agent_processes"))
    info: dict = {"refused": [], "agent_processes_left": 0}
    marks = [("start", time.monotonic())]
    if not keep:
        info["agent_processes_left"] = kill_uid(AGENT_UID)
        if info["agent_processes_left"]:
            return {"error": "AgentProcessesSurvive", "message": "agent processes survive"}, b""
        remove_ipc(AGENT_UID)
        for path in ("/tmp", "/dev/shm", "/dev/mqueue"):
            wipe(path)
    marks.append(("stop_agent", time.monotonic()))
    kill_uid(GRADER_UID)
    remove_ipc(GRADER_UID)
    wipe(GRADE)
    grader = GRADER_UID
    os.chown(GRADE, 0, 0)  # the tmpfs mount point itself
    os.chmod(GRADE, 0o755)
    _dir(TESTS, 0, 0o755)
    for name in ("home", "tmp", "out"):
        _dir(f"{GRADE}/{name}", grader, 0o700)
    if tests_tar:
        _untar_readonly(tests_tar, TESTS)
    tests_dest = req.get("tests_dest")
    if tests_dest:  # a task format's own tests path (open-instruct: /tests), root-owned
        wipe(tests_dest)
        _mount_point(tests_dest, 0, 0o755)
        if tests_tar:
            _untar_readonly(tests_tar, tests_dest)
    result_path = req.get("result_path") or RESULT
    if result_path != RESULT:  # only the tests may write it: its folder starts empty
        top = "/" + result_path.strip("/").split("/")[0]
        wipe(top)
        _mount_point(top, 0, 0o755)
        _makedirs_owned(os.path.dirname(result_path), top, grader)
    fd = os.open(ANSWER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(answer)
    if keep:
        workdir = GRADE + "/workspace"
        _dir(workdir, grader, 0o755)
        info["refused"] = _copy_plain(WORKSPACE, workdir, agent_fs)
        _chown_tree(workdir, grader)
    else:
        workdir = WORKSPACE
        info["refused"] = _make_plain(workdir, grader)
    info["refused"] = _shown(info["refused"])
    marks.append(("prepare", time.monotonic()))
    subject = req.get("subject_command")
    if subject:
        info["subject"] = _run_subject(subject, workdir, req)
        info["subject"]["refused"] = _shown(info["subject"]["refused"])
    env = {
        "PATH": BASE_ENV["PATH"],
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "HOME": GRADE + "/home",
        "TMPDIR": GRADE + "/tmp",
        "PYTHONNOUSERSITE": "1",
        "PYTHONSAFEPATH": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "TESTS_DIR": tests_dest or TESTS,
        "ANSWER_FILE": ANSWER,
        "WORKSPACE": workdir,
        "SANDPIPER_RESULT_FILE": RESULT,
        "SANDPIPER_RESULT_TAG": str(req.get("secret", "")),
        "SUBJECT_OUT": SUBJECT_OUT,
    }
    if not req.get("python_safe_path", True):
        del env["PYTHONSAFEPATH"]  # the task's tests import the agent's modules by design
    header, out, err, _ = spawn(
        ["bash", "-c", req["command"]], env=env, cwd=workdir, timeout_s=float(req["timeout_s"]),
        cap=int(req["cap"]), uid=grader,
    )  # fmt: skip
    marks.append(("tests", time.monotonic()))
    kill_uid(grader)  # nothing of the tests may change the result after they exit
    result, result_error = _read_result(result_path)
    marks.append(("result", time.monotonic()))
    info["phases_ms"] = {
        name: round((t - marks[i][1]) * 1000, 1) for i, (name, t) in enumerate(marks[1:])
    }
    header.update(info, result=result, result_error=result_error, workdir=workdir)
    return exec_reply(header, out, err)


def _run_subject(command: str, workdir: str, req: dict) -> dict:
    """Run the agent's code as the agent (no secret, own home), then freeze its outputs."""
    agent = AGENT_UID
    _dir(SUBJECT_OUT, agent, 0o755)
    _dir(GRADE + "/subject-home", agent, 0o700)
    env = {
        "PATH": BASE_ENV["PATH"],
        "LANG": "C.UTF-8",
        "HOME": GRADE + "/subject-home",
        "TMPDIR": GRADE + "/subject-home",
        "PYTHONNOUSERSITE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "TESTS_DIR": TESTS,
        "WORKSPACE": workdir,
        "SUBJECT_OUT": SUBJECT_OUT,
    }
    header, out, err, _ = spawn(
        ["bash", "-c", command], env=env, cwd=workdir, timeout_s=float(req["timeout_s"]),
        cap=int(req["cap"]), uid=agent,
    )  # fmt: skip
    left = kill_uid(agent)
    remove_ipc(agent)
    if left:
        raise RuntimeError(f"{left} processes of the code under test survive")
    refused = _make_plain(SUBJECT_OUT, 0)  # first: no link of the agent's is written through
    for name, capper in (("stdout", out), ("stderr", err)):
        head, tail = capper.parts()
        path = f"{SUBJECT_OUT}/{name}"
        if os.path.isdir(path):  # only folders and regular files are left
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.unlink(path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        with os.fdopen(os.open(path, flags, 0o644), "wb") as f:
            f.write(head + tail)
    for dirpath, dirnames, filenames in os.walk(SUBJECT_OUT):
        for name in dirnames + filenames:
            os.chmod(os.path.join(dirpath, name), 0o755 if name in dirnames else 0o644)
    os.chown(SUBJECT_OUT, 0, 0)
    return {"exit_code": header["exit_code"], "outcome": header["outcome"], "refused": refused}


def _shown(names: list[str]) -> list[str]:
    """At most ``MAX_REFUSED_SHOWN`` entries: names, each valid UTF-8 (bytes that are not
    are shown as ``\\xNN``), the last saying how many more there were."""
    cut = len(names) > MAX_REFUSED_SHOWN
    kept = names[: MAX_REFUSED_SHOWN - 1] if cut else names
    shown = [n.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace") for n in kept]
    if cut:
        shown.append(f"... and {len(names) - len(kept)} more")
    return shown


def _makedirs_owned(path: str, top: str, owner: int) -> None:
    """Folders from ``top`` (exclusive) down to ``path``, owned by ``owner`` (the grader)."""
    rel = os.path.relpath(path, top)
    current = top
    for part in [] if rel == "." else rel.split("/"):
        current = os.path.join(current, part)
        _dir(current, owner, 0o755)


def _mount_point(path: str, owner: int, mode: int) -> None:
    """Like :func:`_dir` for a folder that may already exist (a tmpfs mount point, emptied)."""
    if os.path.isdir(path) and not os.path.islink(path):
        os.chown(path, owner, owner)
        os.chmod(path, mode)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        _dir(path, owner, mode)


def _dir(path: str, owner: int, mode: int) -> None:
    os.mkdir(path, mode)
    os.chown(path, owner, owner)
    os.chmod(path, mode)


def _untar_readonly(data: bytes, dest: str) -> None:
    """Regular files and folders only, owned by root, never writable by the tests."""
    import io

    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            parts = [p for p in member.name.split("/") if p not in ("", ".")]
            if member.name.startswith("/") or ".." in parts:
                raise ValueError(f"unsafe path in the tests archive: {member.name!r}")
            target = os.path.join(dest, *parts)
            if member.isdir():
                os.makedirs(target, 0o755, exist_ok=True)
            elif member.isfile():
                os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
                src = tar.extractfile(member)
                assert src is not None
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                with os.fdopen(os.open(target, flags, 0o644), "wb") as f:
                    shutil.copyfileobj(src, f)
                os.chmod(target, 0o755 if member.mode & 0o111 else 0o644)


def _make_plain(root: str, owner: int) -> list[str]:
    """In place, with no agent process alive: drop everything that is not a regular file or
    a folder, break hard links, hand the rest to ``owner``. Returns what was dropped."""
    refused = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode):
                os.chown(path, owner, owner, follow_symlinks=False)
                os.chmod(path, (st.st_mode & 0o777) | 0o700)
            elif stat.S_ISREG(st.st_mode):
                if st.st_nlink > 1:  # a private copy: the tests never write through a link
                    tmp = path + ".sandpiper-unlink"
                    shutil.copyfile(path, tmp, follow_symlinks=False)
                    os.replace(tmp, path)
                os.chown(path, owner, owner, follow_symlinks=False)
                os.chmod(path, (st.st_mode & 0o777) | 0o600)
            else:
                refused.append(os.path.relpath(path, root))
                os.unlink(path)
        dirnames[:] = [d for d in dirnames if os.path.isdir(os.path.join(dirpath, d))]
    return refused


def _copy_plain(src_root: str, dest_root: str, reader=contextlib.nullcontext) -> list[str]:
    """Copy regular files and folders (no links followed, size capped). Every source is
    opened inside ``reader()`` (the agent's file-system rights): a live agent can swap paths
    under us but reads nothing it could not; the copies are written as the caller."""
    refused, copied = [], 0
    for dirpath, dirnames, filenames in os.walk(src_root, followlinks=False):
        rel = os.path.relpath(dirpath, src_root)
        for name in dirnames + filenames:
            src = os.path.join(dirpath, name)
            dest = os.path.normpath(os.path.join(dest_root, rel, name))
            try:
                with reader():
                    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                refused.append(os.path.relpath(src, src_root))
                continue
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and copied + st.st_size <= MAX_COPY_BYTES:
                copied += st.st_size
                with os.fdopen(fd, "rb") as f, open(dest, "xb") as out:
                    shutil.copyfileobj(f, out)
                continue
            os.close(fd)
            if stat.S_ISDIR(st.st_mode):
                os.makedirs(dest, 0o755, exist_ok=True)
            else:
                refused.append(os.path.relpath(src, src_root))
    return refused


def _chown_tree(root: str, owner: int) -> None:
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), owner, owner, follow_symlinks=False)


def _read_result(path: str) -> tuple[str | None, str | None]:
    """The result file's text, or why there is none (a link, not a file, too large)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None, "the tests wrote no result file"
    except OSError as e:
        return None, f"the result file cannot be opened: {e.strerror}"
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None, "the result path is not a regular file"
        data = f.read(MAX_RESULT_BYTES + 1)
    if len(data) > MAX_RESULT_BYTES:
        return None, f"the result file exceeds {MAX_RESULT_BYTES} bytes"
    return data.decode("utf-8", "replace"), None
