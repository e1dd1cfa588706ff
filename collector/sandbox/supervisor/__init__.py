"""The supervisor: the persistent shell that runs INSIDE each sandbox container (python3
standard library only).

The host mounts this folder read-only at ``/.sandpiper/supervisor`` (from a content-addressed
copy: ``isolation.mounted_files``), starts it once per container with ``podman exec -i CID
python3 -I /.sandpiper/supervisor/__main__.py --listen SOCKET`` and talks to it over that
Unix socket (bind-mounted from the host, see :func:`.server.listen`; without ``--listen``,
over stdin/stdout) with framed messages (:mod:`.server`).

- :mod:`.server`: the request loop, the socket, start-up;
- :mod:`.run`: one command: started, output capped at the source, killed at the deadline;
- :mod:`.launcher`: the agent's process that starts the agent's commands;
- :mod:`.state`: the working directory and environment kept between commands;
- :mod:`.files`: the file operations on the agent's files;
- :mod:`.reset`: killing processes, removing IPC objects, wiping the writable mounts;
- :mod:`.privileges`: the uids, whether this shell is privileged, the privilege drops;
- :mod:`.grader`: grading at submit, out of the agent's reach;
- :mod:`.procfs`: small kernel files read cheaply.

State semantics: the working directory and the exported environment persist from one command
to the next (bash runs with ``set -a``, so plain ``X=1`` assignments persist too); shell
functions, aliases and shell options do not. Background processes keep running, but output
they write after their command returned is not collected (redirect it to a file).

Users: the supervisor runs as container root (an unprivileged host uid) holding only the
capabilities it needs to manage the container (chown, DAC override, fowner, kill, setuid,
setgid, setpcap). Every agent command runs as ``AGENT_UID`` (started by the launcher, which
has it) with no capabilities and an empty bounding set, so the agent cannot trace, signal or
borrow the file descriptors of the supervisor; a command that kills every process of the
agent (``kill -9 -1``) kills the launcher too and is reported as killed (137). The
agent-facing file operations (the editor, seed files) run with the agent's file-system uid,
so they have exactly the agent's rights. Grading runs the tests as ``GRADER_UID``, a uid the
agent never has.

Nothing here may import from the project or outside the standard library: the container
has only python3. The modules import each other relatively (``from . import ...``): the
package is ``sandpiper.collector.sandbox.supervisor`` on the host (unit tests) and
``supervisor`` in the container (loaded by ``__main__.py``).
"""
