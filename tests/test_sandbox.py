"""envs/sandbox.py under real attacks. Each one must be contained, leave the host as it was and leave no
process behind. Run as root (CI does): that is the hard case, where a sandbox mapped to root would skip the
process limit. Without a working bwrap these tests fail, loudly, on purpose: CI installs bubblewrap."""

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid

import pytest

from envs import sandbox
from envs.sandbox import Limits, Sandbox

OK, WHY = sandbox.probe()
if not OK:
    pytest.fail(f"the sandbox does not work here, so its attack tests cannot run: {WHY}", pytrace=False)

SMALL = Limits(
    cpu_s=3,
    wall_s=4,
    memory_mb=256,
    file_mb=8,
    open_files=32,
    procs=12,
    output_bytes=8192,
    disk_mb=16,
    tmp_mb=8,
)


@pytest.fixture
def sb():
    with Sandbox(SMALL) as s:
        yield s


def marked_pids(mark):
    """Host pids whose environment holds mark (every sandboxed process of a test inherits it)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def attack(sb, argv, limits=None, stdin=b""):
    """Run argv marked; assert that nothing of it is left on the host afterwards; return the Result."""
    mark = f"NANOGLM_MARK_{uuid.uuid4().hex}"
    r = sb.run(argv, env={"MARK": mark}, limits=limits, stdin=stdin)
    assert marked_pids(mark) == [], f"processes left behind: {r}"
    return r


def py(sb, code, limits=None):
    return attack(sb, [sb.python, "-c", code], limits)


def sh(sb, command, limits=None):
    return attack(sb, ["/bin/bash", "-c", command], limits)


# -----------------------------------------------------------------------------
# It works, and it is what it says


def test_runs_as_nobody_in_a_private_world(sb):
    r = sh(sb, "id -u; hostname; pwd; ls /; echo hi > /work/f; cat /work/f; ls /proc | grep -c '^[0-9]'")
    assert r.ok, r
    uid, host, cwd, *rest = r.stdout.split("\n")
    assert (uid, host, cwd) == ("65534", "sandbox", "/work")
    assert not {"home", "root", "var", "run", "mnt", "opt", "srv", "boot"} & set(rest), r.stdout
    assert int(rest[-2]) <= 4  # bwrap's pid 1, bash, ls, grep: nothing of the host's process table
    assert open(os.path.join(sb.workdir, "f")).read() == "hi\n"  # the work dir is the host's view of /work


def test_the_sandbox_is_nobody_on_the_host_too(sb):
    """Outside the namespaces the sandbox's processes belong to uid 65534, not to the caller (root here)."""
    mark = uuid.uuid4().hex
    t = threading.Thread(target=sb.run, args=(["sleep", "2"],), kwargs={"env": {"MARK": mark}})
    t.start()
    time.sleep(1)
    pids = marked_pids(mark)
    uids = {open(f"/proc/{p}/status").read().split("Uid:")[1].split()[0] for p in pids}
    t.join()
    assert pids and uids == {"65534"}, (pids, uids)


def test_no_bwrap_means_sandboxed_false_and_a_refusal(monkeypatch):
    monkeypatch.setattr(sandbox, "_PROBE", None)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(sandbox.SandboxUnavailable, match="bwrap not found"):
        Sandbox()
    with Sandbox(require=False) as s:
        assert s.sandboxed is False and "bwrap" in s.why
        with pytest.raises(sandbox.SandboxUnavailable, match="refusing"):
            s.run(["true"])


def test_bwrap_is_started_by_its_full_path(sb):
    """bwrap starts with an empty environment, where a bare name is looked up in /bin:/usr/bin only: one
    installed elsewhere on PATH (seen: unpacked under /tmp on a GPU machine without the package) must still
    be the one that runs."""
    argv = sb.command(["true"], sb.limits, [], 0, {})
    assert os.path.isabs(argv[0]) and argv[0] == shutil.which("bwrap")


def test_a_bwrap_that_cannot_start_is_a_refusal_not_a_traceback(monkeypatch):
    """A bwrap found on PATH that cannot be executed (a text file with the exec bit), in a directory anyone
    can enter, makes the probe refuse in one sentence; as root, one under a private directory is refused
    before it is tried (bwrap is started as uid 65534, which could not reach it)."""
    public = tempfile.mkdtemp(dir="/tmp")
    try:
        os.chmod(public, 0o755)
        with open(os.path.join(public, "bwrap"), "w") as f:
            f.write("not a program\n")
        os.chmod(os.path.join(public, "bwrap"), 0o755)
        monkeypatch.setattr(sandbox, "_PROBE", None)
        monkeypatch.setenv("PATH", f"{public}:{os.environ['PATH']}")
        with Sandbox(require=False) as s:
            assert s.sandboxed is False and "bwrap could not be started" in s.why, s.why
        if os.geteuid() == 0:
            os.chmod(public, 0o700)
            monkeypatch.setattr(sandbox, "_PROBE", None)
            with Sandbox(require=False) as s:
                assert s.sandboxed is False and "uid 65534 cannot enter" in s.why, s.why
    finally:
        shutil.rmtree(public)
        monkeypatch.setattr(sandbox, "_PROBE", None)  # the next test probes the real bwrap again


# -----------------------------------------------------------------------------
# Processes: fork bombs, setsid escapes, killing pid 1 and the parent


COUNT_CHILDREN = (
    "import os, time\nn = 0\nfor i in range(100):\n    try:\n        pid = os.fork()\n    except OSError:\n"
    "        break\n    if pid == 0:\n        time.sleep(2)\n        os._exit(0)\n    n += 1\nprint(n)"
)


def test_process_limit_binds_even_when_the_caller_is_root(sb):
    """Count how many children can exist at once (bounded, so a broken limit cannot take the host down)."""
    r = py(sb, COUNT_CHILDREN)
    assert r.ok, r
    assert 0 < int(r.stdout) < SMALL.procs, r.stdout


def test_a_full_sandbox_does_not_starve_another():
    """Process limits count per sandbox: one holding all of its processes leaves the other its full budget."""
    hold = COUNT_CHILDREN.replace("time.sleep(2)", "time.sleep(3)")
    with Sandbox(SMALL) as a, Sandbox(SMALL) as b:
        res = {}
        t = threading.Thread(target=lambda: res.setdefault("a", a.run_python(hold)))
        t.start()
        time.sleep(0.7)
        res["b"] = b.run_python(COUNT_CHILDREN)
        t.join()
    assert res["a"].stdout == res["b"].stdout == f"{SMALL.procs - 2}\n", res  # all but pid 1 and python


def test_fork_bomb(sb):
    # the bomb ends by a limit (or by the failed forks), not after its `sleep 100`; sh() checks that no
    # process of it is left on the host
    r = sh(sb, ":(){ :|:& };:; sleep 100")
    assert r.killed in ("wall", "cpu") or r.returncode != 0, r
    assert subprocess.run(["true"]).returncode == 0  # the host still forks


def test_setsid_double_fork_daemon_dies_with_the_run(sb):
    """A grandchild in its own session that ignores SIGHUP/SIGTERM and would write a file a second later."""
    code = (
        "import os, signal, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
        "        signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "        os.close(1); os.close(2)\n        time.sleep(1)\n"
        "        open('/work/escaped', 'w').write('x')\n"
        "    os._exit(0)\nprint('parent done')"
    )
    for _ in range(8):  # the race between run() returning and the kernel emptying the namespace, many times
        r = py(sb, code)  # py() asserts that no marked process is left once run() returns
        # the run ended with its parent (no limit hit), and did not wait for the daemon, which would then
        # have written its file
        assert r.ok and not r.killed and r.stdout == "parent done\n", r
    time.sleep(1.5)
    assert not os.path.exists(os.path.join(sb.workdir, "escaped"))


def test_killing_pid_1_the_parent_and_everyone(sb):
    """kill -9 -1, pid 1 and the parent from inside; host processes, ours and nobody's, survive."""
    root_sentinel = subprocess.Popen(["sleep", "30"])
    nobody_sentinel = subprocess.Popen(["sleep", "30"], user=65534, group=65534, extra_groups=[])
    try:
        r = sh(
            sb,
            f"kill -9 {root_sentinel.pid} {nobody_sentinel.pid} {os.getpid()}; kill -9 $PPID; kill -9 1; "
            f"kill -9 -1; echo still here",
        )
        r2 = py(
            sb,
            f"import os, signal\nfor p in (1, os.getppid(), {os.getpid()}, -1):\n    try:\n"
            f"        os.kill(p, signal.SIGKILL)\n    except OSError as e:\n        print(p, e.errno)\n"
            f"print('alive')",
        )
        # pid 1 ignores its own namespace's kills
        assert "still here" in r.stdout and "alive" in r2.stdout, (r, r2)
        time.sleep(0.2)
        assert root_sentinel.poll() is None and nobody_sentinel.poll() is None, "a host process was killed"
    finally:
        for s in (root_sentinel, nobody_sentinel):
            s.kill()
            s.wait()


# -----------------------------------------------------------------------------
# CPU, wall clock, memory, output, disk, file descriptors


def test_infinite_loop_hits_the_cpu_limit(sb):
    r = py(sb, "while True: pass", limits=Limits(cpu_s=1, wall_s=10))
    assert r.killed == "cpu", r  # SIGXCPU from RLIMIT_CPU, not the 10 s wall clock


def test_sleep_past_the_wall_clock(sb):
    r = sh(sb, "sleep 60", limits=Limits(wall_s=1))
    assert r.killed == "wall" and r.returncode != 0, r  # killed by run(), not a sleep that finished


def test_memory_bomb(sb):
    """Allocate and touch 32 MB chunks up to 1 GB (bounded): RLIMIT_AS stops it near memory_mb."""
    r = py(
        sb,
        "a = []\ntry:\n    for i in range(32):\n        a.append(bytearray(32 << 20))\nexcept MemoryError:\n"
        "    pass\nprint(32 * len(a))",
    )
    assert r.ok, r
    assert int(r.stdout) < SMALL.memory_mb, r.stdout


def test_huge_output_is_capped_and_stopped(sb):
    # stopped at the cap (killed == "output"), not by the wall clock
    r = sh(sb, "yes AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA")
    assert r.truncated and r.killed == "output" and len(r.stdout) == SMALL.output_bytes, (
        len(r.stdout),
        r.killed,
    )
    r = sh(sb, "yes 1>&2")
    assert r.truncated and r.killed == "output" and len(r.stderr) == SMALL.output_bytes, r.killed


def test_filling_the_disk(sb):
    """Write 4 MB files to /work, /tmp and /dev/shm until refused (at most 512 MB in all, so a broken cap
    cannot fill the host): the work dir holds at most disk_mb, the rest vanishes with the run."""
    assert sb.disk_capped, "as root the work dir must be a size-capped tmpfs"
    r = sh(
        sb,
        "n=0; for d in /work /tmp /dev/shm; do for i in $(seq 40); do "
        "head -c 4194304 /dev/zero > $d/f$i 2>/dev/null && n=$((n+4)) || break; done; done; echo $n",
    )
    assert r.ok, r
    assert int(r.stdout) <= SMALL.disk_mb + 2 * SMALL.tmp_mb, r.stdout
    used = sum(os.path.getsize(os.path.join(sb.workdir, f)) for f in os.listdir(sb.workdir))
    assert used <= SMALL.disk_mb << 20


def test_file_size_limit(sb):
    r = sh(sb, "head -c 20000000 /dev/zero > /work/big; echo $?")
    assert r.stdout == f"{128 + signal.SIGXFSZ}\n", r  # head was killed by SIGXFSZ at file_mb
    assert os.path.getsize(os.path.join(sb.workdir, "big")) == SMALL.file_mb << 20


def test_exhausting_file_descriptors(sb):
    r = py(
        sb,
        "fs = []\ntry:\n    for i in range(5000):\n        fs.append(open('/dev/null'))\nexcept OSError:\n"
        "    pass\nprint(len(fs))",
    )
    assert r.ok and int(r.stdout) < SMALL.open_files, r
    assert os.open("/dev/null", os.O_RDONLY) >= 0  # the host can still open files (closed at exit)


# -----------------------------------------------------------------------------
# Network, files and secrets of the host


def test_no_network_not_even_the_hosts_loopback(sb):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    try:
        r = py(
            sb,
            f"import socket\nfor host, port in (('127.0.0.1', {port}), ('1.1.1.1', 53), ('8.8.8.8', 443)):\n"
            f"    s = socket.socket(); s.settimeout(2)\n    try:\n"
            f"        s.connect((host, port)); print('CONNECTED', host)\n"
            f"    except OSError as e:\n        print('refused', host)\ntry:\n"
            f"    socket.getaddrinfo('example.com', 80); print('RESOLVED')\n"
            f"except OSError:\n    print('no dns')\n"
            f"print(sorted(n for _, n in socket.if_nameindex()))",
        )
    finally:
        server.close()
    assert r.ok, r
    assert "CONNECTED" not in r.stdout and "RESOLVED" not in r.stdout and "no dns" in r.stdout, r.stdout
    assert r.stdout.strip().endswith("['lo']"), r.stdout


def test_writes_outside_the_work_dir_fail_or_vanish(sb):
    name = f"nanoglm-escape-{uuid.uuid4().hex}"
    r = sh(
        sb,
        f"for p in /{name} /usr/{name} /etc/{name} /dev/{name} /proc/{name} /bin/{name}; do "
        f"echo x > $p 2>/dev/null && echo WROTE $p; done; echo x > /tmp/{name} && echo tmp ok",
    )
    assert "WROTE" not in r.stdout and "tmp ok" in r.stdout, r
    for d in ("/", "/usr", "/etc", "/tmp", "/dev"):  # the private /tmp is not the host's
        assert not os.path.exists(os.path.join(d, name))
    assert sh(sb, f"cat /tmp/{name}").returncode != 0  # and it is gone after the run


def test_canary_file_in_the_callers_home(sb):
    home = os.path.expanduser("~")
    secret = uuid.uuid4().hex
    path = os.path.join(home, f".nanoglm-canary-{secret[:8]}")
    with open(path, "w") as f:
        f.write(secret)
    try:
        r = sh(
            sb,
            f"cat {path}; cat ~/{os.path.basename(path)}; ls -a {home}; "
            f"grep -rs {secret} /work /tmp /etc /dev/shm; echo end",
        )
    finally:
        os.remove(path)
    assert secret not in r.stdout + r.stderr and r.stdout.endswith("end\n"), r


def test_canary_env_var_is_nowhere_not_in_proc(sb, monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("NANOGLM_CANARY", secret)
    r = sh(
        sb,
        "env; cat /proc/1/environ /proc/self/environ /proc/*/environ /proc/*/cmdline 2>/dev/null; "
        "echo; echo pid1 environ: $(wc -c < /proc/1/environ) bytes",
    )
    assert r.ok and secret not in r.stdout + r.stderr, r
    assert r.stdout.endswith("pid1 environ: 0 bytes\n"), r.stdout  # pid 1 (bwrap) has an empty environment


def test_host_side_file_access_never_follows_planted_links(sb):
    before = open("/etc/hostname", "rb").read()
    r = sh(sb, "ln -s /etc/hostname link; ln -s / rootlink; mkfifo fifo; mkdir d; ln -s /etc d/inner")
    assert r.ok, r
    assert sb.read("link") is None and sb.read("rootlink/etc/hostname") is None and sb.read("fifo") is None
    assert sb.read("d/inner/hostname") is None and sb.listdir("rootlink") is None
    sb.write("link", "overwritten")  # replaces the link itself
    sb.write("d/new.txt", "fine")
    assert open("/etc/hostname", "rb").read() == before
    assert sb.read("link") == b"overwritten" and sb.read("d/new.txt") == b"fine"
    with pytest.raises(ValueError):
        sb.write("../escape", "x")


def test_two_sandboxes_at_once_do_not_see_each_other(tmp_path):
    secret = uuid.uuid4().hex
    results = {}
    with Sandbox(SMALL) as a, Sandbox(SMALL) as b:

        def run_a():
            results["a"] = a.run(
                [
                    "/bin/bash",
                    "-c",
                    f"echo {secret} > /work/a.txt; echo {secret} > /tmp/a.txt; "
                    f"echo {secret} > /dev/shm/a; sleep 2; cat /work/a.txt",
                ]
            )

        t = threading.Thread(target=run_a)
        t.start()
        time.sleep(0.7)
        results["b"] = b.run(
            [
                "/bin/bash",
                "-c",
                f"ls -a /work /tmp /dev/shm; cat {a.workdir}/a.txt; "
                f"grep -rs {secret} /work /tmp /dev/shm /proc/*/cmdline; "
                f"ls /proc | grep -c '^[0-9]'",
            ]
        )
        t.join()
        assert results["a"].ok and results["a"].stdout == secret + "\n", results["a"]
        out = results["b"].stdout + results["b"].stderr
        assert secret not in out and "a.txt" not in results["b"].stdout, results["b"]
        assert int(results["b"].stdout.split()[-1]) <= 5  # only its own processes
        assert b.read("a.txt") is None and a.read("a.txt") == (secret + "\n").encode()
