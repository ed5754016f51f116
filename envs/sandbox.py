"""
The sandbox that runs model-written code and shell commands for the RL environments (GLM-5 report, arXiv
2602.15763, its agentic RL sections: the environments execute what the model writes and verify the result).
The code and terminal environments of envs/ use it; it imports nothing of the project, so it also runs as a
script.

One Sandbox is one private, throwaway work dir; each run() is a fresh bubblewrap (`bwrap`) container over
it: its own namespaces, an unprivileged uid inside and out, an empty environment, prlimit limits set inside,
a wall clock that kills the whole pid namespace, capped output. Without a working bwrap, `sandboxed` is
False, `why` says why, and run() refuses (SandboxUnavailable): nothing ever runs unsandboxed. The container
and the reason for each choice are described at the Sandbox class.

Run it:
    python envs/sandbox.py                   # per-execution overhead: sandboxed vs plain, side by side
    python envs/sandbox.py sh -c 'id; ls /'  # run one command in a sandbox, print the Result
Tests: python -m pytest -q tests/test_sandbox.py     (real attacks; run them as root, the hard case)
Does NOT protect against: kernel exploits (no seccomp filter: every syscall the namespaces allow is
allowed); side channels and CPU contention (no cgroup: memory is capped per process by RLIMIT_AS, so all
processes together may use up to procs x memory_mb); reading what the read-only system dirs hold (/usr is
visible); disk filling when not root (the work dir is then a plain directory: only the per-file limit
applies, disk_capped is False); a crash of our own process before close() leaves the work dir mounted.
"""

import argparse
import ctypes
import dataclasses
import json
import os
import platform
import select
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import weakref

UID = GID = 65534  # "nobody": the sandbox's uid inside, and outside too when the caller is root
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64")
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime")  # dynamic linking
# so that `id` and `whoami` work inside
PASSWD = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/work:/bin/sh\n"
GROUP = "root:x:0:\nnogroup:x:65534:\n"


class SandboxUnavailable(RuntimeError):
    pass


# -----------------------------------------------------------------------------
# Limits and results


@dataclasses.dataclass
class Limits:
    cpu_s: int = 10  # CPU seconds per process (RLIMIT_CPU): SIGXCPU, SIGKILL one second later
    wall_s: float = 20.0  # the whole run; then every process of the sandbox is killed
    memory_mb: int = 512  # address space per process (RLIMIT_AS)
    file_mb: int = 16  # the largest file a process may write (RLIMIT_FSIZE)
    open_files: int = 64  # RLIMIT_NOFILE
    procs: int = 16  # processes and threads in the sandbox, its pid 1 included (RLIMIT_NPROC)
    output_bytes: int = 64 * 1024  # stdout and stderr each; beyond this the run is killed and the output cut
    disk_mb: int = 64  # the work dir, when it is a tmpfs (caller is root)
    tmp_mb: int = 16  # /tmp and /dev/shm, each


@dataclasses.dataclass
class Result:
    returncode: int  # the command's exit status; 128 + N when signal N killed it
    stdout: str
    stderr: str
    seconds: float
    killed: str = ""  # why it did not end on its own: "wall", "output", "cpu" (SIGXCPU) or "signal N"
    truncated: bool = False  # output past Limits.output_bytes was dropped

    @property
    def ok(self):
        return self.returncode == 0 and not self.killed


# -----------------------------------------------------------------------------
# Finding what the sandbox needs on this machine, once


def reachable_by_others(path):
    """True if every directory above path can be traversed by an unrelated uid (bwrap runs as one)."""
    path = os.path.realpath(path)
    while path != "/":
        path = os.path.dirname(path)
        if not os.stat(path).st_mode & stat.S_IXOTH:
            return False
    return True


def find_python():
    """(interpreter path inside the sandbox, host dir to bind for it or None): ours if the sandbox can reach
    it, else the system's. (pyenv under /root is not reachable by nobody, so /usr/bin/python3 is used.)"""
    exe = os.path.realpath(sys.executable)
    if exe.startswith("/usr/"):
        return exe, None
    prefix = os.path.realpath(sys.base_prefix)
    if prefix not in ("/", "/usr") and exe.startswith(prefix + "/") and reachable_by_others(prefix):
        return exe, prefix
    for exe in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(exe):
            return os.path.realpath(exe), None
    return None, None


_PROBE = None  # (ok, why), computed by the first Sandbox


def probe():
    """Can we sandbox here? Runs `true` in a real sandbox once per process; returns (ok, why)."""
    global _PROBE
    if _PROBE is None:
        if sys.platform != "linux":
            _PROBE = False, f"bubblewrap needs Linux, this is {sys.platform}"
        elif not shutil.which("bwrap"):
            _PROBE = False, "bwrap not found; install bubblewrap (apt-get install -y bubblewrap)"
        elif os.geteuid() == 0 and not reachable_by_others(shutil.which("bwrap")):
            # as root, bwrap is started as uid 65534, which must be able to reach it
            _PROBE = False, (
                f"bwrap at {shutil.which('bwrap')} is under a directory uid 65534 cannot enter; "
                "install bubblewrap system-wide (apt-get install -y bubblewrap)"
            )
        elif not shutil.which("prlimit"):
            _PROBE = False, "prlimit not found; install util-linux"
        else:
            try:
                with Sandbox(_probing=True) as sb:
                    r = sb.run(["true"], limits=Limits(wall_s=20))
            except OSError as e:  # bwrap found but not startable: said in one sentence, not a traceback
                _PROBE = False, f"bwrap could not be started: {e}"
            else:
                if r.ok:
                    _PROBE = True, ""
                else:
                    _PROBE = False, f"bwrap does not work here: {r.stderr.strip()[-300:]}"
    return _PROBE


# -----------------------------------------------------------------------------
# The work dir: a size-capped tmpfs when we are root (so filling it cannot fill the host's disk)

_libc = ctypes.CDLL(None, use_errno=True)
MS_NOSUID, MS_NODEV, MNT_DETACH = 2, 4, 2


def mount_tmpfs(path, mb):
    opts = f"size={mb}m,nr_inodes={max(1024, mb * 64)},mode=0700,uid={UID},gid={GID}".encode()
    return (
        _libc.mount(b"nanoglm-sandbox", path.encode(), b"tmpfs", ctypes.c_ulong(MS_NOSUID | MS_NODEV), opts)
        == 0
    )


def remove_workdir(path, mounted):
    if mounted:
        _libc.umount2(path.encode(), MNT_DETACH)
    shutil.rmtree(path, ignore_errors=True)


# -----------------------------------------------------------------------------
# The sandbox
#
# Each run() is a fresh bubblewrap (`bwrap`) container over the work dir:
#
#   bwrap: own user, pid, network, ipc, uts (and cgroup) namespaces; uid 65534 inside
#     /usr, /bin, /lib... read-only       /work  the work dir (read-write; a size-capped tmpfs as root)
#     /proc fresh (only the sandbox's)    /tmp, /dev/shm  private size-capped tmpfs, gone after the run
#     /dev minimal                        /sandbox/...  read-only files that exist only for this run (memfds)
#     nothing else: no /home, /root, /var, /run, no host /tmp, no network but its own loopback
#     -> prlimit (CPU, address space, file size, open files, processes, no core) -> the command
#
# - An unprivileged uid outside too: when the caller is root, bwrap itself is started as uid 65534, so the
#   sandbox is nobody on the host. Were it mapped to root (bwrap --uid as root), the kernel would skip
#   RLIMIT_NPROC for it and a fork bomb would run free.
# - The limits are set inside, after the namespaces exist, so RLIMIT_NPROC counts this sandbox's processes
#   only and two sandboxes cannot starve each other's process budget.
# - The environment is empty: bwrap itself is started with env={} (it becomes the sandbox's pid 1, so
#   /proc/1/environ is empty too) and the command gets only PATH, HOME, LANG.
# - Wall clock: bwrap --info-fd tells us the host pid of the sandbox's pid 1, which we hold as a pidfd (never
#   a recycled pid); killing it makes the kernel kill every process in the pid namespace, children that called
#   setsid and double-forked included. When the command exits on its own, bwrap returns at once, so run()
#   kills pid 1 anyway and waits for its exit: only then is the namespace empty. --die-with-parent covers our
#   own death.
# - Output: stdout and stderr are read as they come; past `output_bytes` the run is killed and cut.
# - Host-side file access (write/read/listdir) walks the work dir with O_NOFOLLOW, so a symlink planted by the
#   sandbox (answer.txt -> /etc/shadow) cannot make the host, maybe root, read or write outside it.


class Sandbox:
    """A private work dir (/work inside) and the means to run untrusted commands over it."""

    def __init__(self, limits=None, require=True, _probing=False):
        """require=False: do not raise when sandboxing is impossible; look at .sandboxed and .why instead."""
        self.limits = limits or Limits()
        self.sandboxed, self.why = (True, "") if _probing else probe()
        if require and not self.sandboxed:
            raise SandboxUnavailable(f"cannot sandbox: {self.why}")
        self.root = os.geteuid() == 0
        self.python, self.python_prefix = find_python()
        self.workdir = tempfile.mkdtemp(prefix="nanoglm-sandbox-")
        self.disk_capped = self.root and mount_tmpfs(self.workdir, self.limits.disk_mb)
        if self.root:
            os.chown(self.workdir, UID, GID)
        self._finalizer = weakref.finalize(self, remove_workdir, self.workdir, self.disk_capped)

    def close(self):
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- the bwrap command line

    def command(self, argv, L, files, info_fd, env):
        a = [
            # its full path: bwrap starts with an empty environment, so a bare name is looked up in
            # /bin:/usr/bin only, and a bwrap elsewhere on PATH raised FileNotFoundError in the probe's run
            shutil.which("bwrap"),
            "--unshare-user",
            "--unshare-ipc",
            "--unshare-pid",
            "--unshare-net",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--die-with-parent",
            "--new-session",
            "--uid",
            str(UID),
            "--gid",
            str(GID),
            "--hostname",
            "sandbox",
            "--clearenv",
        ]
        for k, v in {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": "/work",
            "LANG": "C.UTF-8",
            **(env or {}),
        }.items():
            a += ["--setenv", k, v]
        for d in SYSTEM_DIRS:  # merged-/usr systems have /bin -> usr/bin etc.: recreate those links
            if os.path.islink(f"/{d}"):
                a += ["--symlink", os.readlink(f"/{d}"), f"/{d}"]
            elif os.path.isdir(f"/{d}"):
                a += ["--ro-bind", f"/{d}", f"/{d}"]
        for f in ETC_FILES:
            a += ["--ro-bind-try", f"/etc/{f}", f"/etc/{f}"]
        if self.python_prefix:
            a += ["--ro-bind", self.python_prefix, self.python_prefix]
        a += [
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--size",
            str(L.tmp_mb << 20),
            "--tmpfs",
            "/dev/shm",
            "--size",
            str(L.tmp_mb << 20),
            "--tmpfs",
            "/tmp",
            "--bind",
            self.workdir,
            "/work",
        ]
        for fd, dest in files:
            a += ["--ro-bind-data", str(fd), dest]
        # Everything bwrap created on its root and in /dev read-only now; /work, /tmp, /dev/shm are their own
        # mounts.
        a += [
            "--remount-ro",
            "/dev",
            "--remount-ro",
            "/",
            "--chdir",
            "/work",
            "--info-fd",
            str(info_fd),
            "--",
        ]
        a += [
            shutil.which("prlimit"),
            f"--cpu={L.cpu_s}:{L.cpu_s + 1}",
            f"--as={L.memory_mb << 20}",
            f"--fsize={L.file_mb << 20}",
            f"--nofile={L.open_files}",
            f"--nproc={L.procs}",
            "--core=0",
            "--",
        ]
        return a + list(argv)

    # --- running

    def run(self, argv, stdin=b"", files=None, env=None, limits=None):
        """Run argv in a fresh container over the work dir. files: {"/sandbox/name": str or bytes}, read-only
        files that exist only during this run; env: extra variables. Returns a Result."""
        if not self.sandboxed:
            raise SandboxUnavailable(f"refusing to run unsandboxed: {self.why}")
        L = limits or self.limits
        files = {"/etc/passwd": PASSWD, "/etc/group": GROUP, **(files or {})}
        fds = [memfd(data) for data in files.values()]
        stdin_fd = memfd(stdin)
        info_r, info_w = os.pipe()
        t0 = time.perf_counter()
        drop = {"user": UID, "group": GID, "extra_groups": []} if self.root else {}
        try:
            p = subprocess.Popen(
                self.command(argv, L, list(zip(fds, files)), info_w, env),
                stdin=stdin_fd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={},
                pass_fds=[info_w, *fds],
                start_new_session=True,
                **drop,
            )
        finally:
            for fd in [info_w, stdin_fd, *fds]:
                os.close(fd)
        out, info, killed, truncated = {p.stdout: bytearray(), p.stderr: bytearray()}, bytearray(), "", False
        pidfd = None  # the sandbox's pid 1, held by a pidfd so that a recycled pid number can never be hit
        sel = selectors.DefaultSelector()
        for f in out:
            sel.register(f, selectors.EVENT_READ)
        sel.register(info_r, selectors.EVENT_READ)

        def kill(why):
            nonlocal killed, kill_t
            killed, kill_t = killed or why, kill_t or time.perf_counter()
            # pid 1 first: the kernel then kills all of it
            if pidfd:
                try:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        deadline, kill_t = t0 + L.wall_s, 0.0
        while sel.get_map():
            left = deadline - time.perf_counter()
            if left <= 0 and not killed:
                kill("wall")
            # after a kill the pipes close as soon as the namespace is gone; 5 s more is a safety net
            for key, _ in sel.select(max(0.0, left) if not killed else 5.0):
                fd = key.fileobj if key.fileobj == info_r else key.fileobj.fileno()
                data = os.read(fd, 65536)
                if not data:
                    sel.unregister(key.fileobj)
                elif key.fileobj == info_r:
                    info += data
                    pidfd = pidfd or open_pid1(info)
                else:
                    buf = out[key.fileobj]
                    if len(buf) + len(data) > L.output_bytes:
                        truncated = True
                        kill("output")
                    buf += data[: L.output_bytes - len(buf)]
            if killed and time.perf_counter() > kill_t + 5.0:
                break  # should never happen: something still holds our pipes
        sel.close()
        os.close(info_r)
        try:
            rc = p.wait(max(0.1, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:  # every pipe closed but the process lives on
            kill("wall")
            rc = p.wait()
        for f in out:
            f.close()
        # bwrap exits as soon as the command does, while the kernel may still be killing the rest of the pid
        # namespace (a setsid daemon, say). Kill its pid 1 to be sure and wait for its exit, which the kernel
        # signals only once every other process in the namespace is gone.
        if pidfd:
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            select.select([pidfd], [], [], 5.0)  # a pidfd turns readable when its process has exited
            os.close(pidfd)
        if rc == 128 + signal.SIGXCPU and not killed:
            killed = "cpu"
        elif rc > 128 and not killed:
            killed = f"signal {rc - 128}"
        return Result(
            rc,
            out[p.stdout].decode(errors="replace"),
            out[p.stderr].decode(errors="replace"),
            time.perf_counter() - t0,
            killed,
            truncated,
        )

    def run_python(self, code, **kw):
        if not self.python:
            raise SandboxUnavailable(
                "no Python interpreter the sandbox can reach (looked for ours and /usr/bin/python3)"
            )
        return self.run([self.python, "-c", code], **kw)

    def shell(self, command, **kw):
        return self.run(["/bin/bash", "-c", command], **kw)

    # --- host-side access to the work dir, never following a link the sandbox planted

    def _dir(self, parts, create=False):
        fd = os.open(self.workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        for part in parts:
            if part in ("", ".", ".."):
                os.close(fd)
                raise ValueError(f"bad path component {part!r}")
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    if self.root:
                        os.chown(part, UID, GID, dir_fd=fd, follow_symlinks=False)
                except FileExistsError:
                    pass
            try:
                nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            finally:
                os.close(fd)
            fd = nfd
        return fd

    def write(self, path, data, mode=0o644):
        """Write a file at path (relative to the work dir), replacing whatever is there, owned by the
        sandbox."""
        *dirs, name = path.split("/")
        fd = self._dir(dirs, create=True)
        try:
            try:
                os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                pass
            f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode, dir_fd=fd)
            with open(f, "wb") as fh:
                fh.write(data.encode() if isinstance(data, str) else data)
                if self.root:
                    os.fchown(fh.fileno(), UID, GID)
        finally:
            os.close(fd)

    def read(self, path, limit=1 << 20):
        """The bytes of a regular file (at most limit), or None if it is missing, a link, a dir or a FIFO."""
        *dirs, name = path.split("/")
        try:
            fd = self._dir(dirs)
        except (FileNotFoundError, NotADirectoryError, OSError):
            return None
        try:
            f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        except OSError:
            return None
        finally:
            os.close(fd)
        with open(f, "rb") as fh:
            return fh.read(limit) if stat.S_ISREG(os.fstat(fh.fileno()).st_mode) else None

    def listdir(self, path=""):
        """Sorted names in a directory of the work dir, or None if it is not a real directory."""
        try:
            fd = self._dir([p for p in path.split("/") if p])
        except OSError:
            return None
        try:
            return sorted(os.listdir(fd))
        finally:
            os.close(fd)


def open_pid1(info):
    """A pidfd on the sandbox's pid 1 once bwrap's --info-fd JSON is complete, checked to be in the new pid
    namespace (so never an unrelated process that got a recycled pid); None if it has already exited."""
    if not info.endswith(b"}\n"):
        return None
    d = json.loads(info)
    try:
        fd = os.pidfd_open(d["child-pid"])
    except ProcessLookupError:
        return None
    try:
        if os.stat(f"/proc/{d['child-pid']}/ns/pid").st_ino == d["pid-namespace"]:
            return fd
    except OSError:
        pass  # a zombie has no namespaces left: its namespace is already empty
    os.close(fd)
    return None


def memfd(data):
    """An anonymous in-memory file holding data, positioned at its start (bwrap and stdin read from it)."""
    fd = os.memfd_create("nanoglm-sandbox")
    os.write(fd, data.encode() if isinstance(data, str) else data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


# -----------------------------------------------------------------------------
# python envs/sandbox.py: the per-execution overhead, side by side


def bench(n=20):
    """Median seconds per run: (sandboxed, plain) for `true` and for `python -c pass`."""
    with Sandbox() as sb:
        rows = []
        for name, argv in (("true", ["true"]), ("python -c pass", [sb.python, "-c", "pass"])):
            ts_sb, ts_plain = [], []
            for _ in range(n):  # interleaved, so background load hits both alike
                t = time.perf_counter()
                assert sb.run(argv).ok
                ts_sb.append(time.perf_counter() - t)
                t = time.perf_counter()
                subprocess.run(argv, check=True, env={})
                ts_plain.append(time.perf_counter() - t)
            rows.append((name, sorted(ts_sb)[n // 2], sorted(ts_plain)[n // 2]))
    return rows


def report():
    """Print the machine and the overhead table (python envs/sandbox.py, python -m envs --bench)."""
    print(
        f"machine: {platform.node()}, {os.cpu_count()} CPUs, {platform.platform()}, bwrap "
        f"{subprocess.run(['bwrap', '--version'], capture_output=True, text=True).stdout.split()[-1]}, "
        f"running as uid {os.geteuid()}"
    )
    for name, t_sb, t_plain in bench():
        print(
            f"{name:>15}: sandboxed {t_sb * 1e3:6.1f} ms, plain {t_plain * 1e3:6.1f} ms, "
            f"overhead {(t_sb - t_plain) * 1e3:5.1f} ms per execution ({t_sb / t_plain:.1f}x)"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        usage="%(prog)s [-h] [COMMAND [ARG ...]]",
        description="The sandbox of the RL environments: time its per-execution overhead, sandboxed vs "
        "plain, or run one command in a fresh sandbox and print the Result. Needs a working bubblewrap.",
        epilog="example: python envs/sandbox.py sh -c 'id; ls /'",
    )
    ap.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="a command and its arguments to run in a sandbox (default: none, time the overhead instead)",
    )
    command = ap.parse_args().command
    ok, why = probe()
    if not ok:
        sys.exit(f"sandboxed=False: {why}")
    if command:
        with Sandbox() as sb:
            print(sb.run(command))
        sys.exit()
    report()
