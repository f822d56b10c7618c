"""Python processes for tests, started from a warm parent: ``warm.run`` and ``warm.Popen``
are ``subprocess.run`` and ``subprocess.Popen`` for ``[sys.executable, ...]`` commands.

A test that starts ``python -c CODE`` (or ``-m MODULE``, or ``SCRIPT``) pays the interpreter's
imports of torch, Dynamo and JAX before its first line: 5-8 s on a 2-core machine. Here a
server process (one per test process, started at the first call) has imported them once,
without starting any backend, and forks a child per command; the child sets up what a fresh
interpreter would have (standard streams, working directory, environment and what the imports
add to it, ``sys.argv`` and ``sys.orig_argv``, ``sys.path`` from ``PYTHONPATH``, a new
``__main__``, warnings filters, fresh random seeds), runs the command as Python runs it, and
ends as Python ends (non-daemon threads joined, ``atexit`` handlers run, streams flushed, the
status of ``SystemExit``, 1 after an uncaught exception, killed by SIGINT after an uncaught
``KeyboardInterrupt``). A child that execs this Python again (the ``xlatorch.compat`` runner)
runs the new command in place, with the modules it imported since the fork dropped.
``tests/test_warm.py`` compares such children with fresh interpreters.

A command the warm parent cannot stand for starts a real interpreter (``subprocess``):
another executable, a shell, interpreter options other than ``-W`` and those the server has
already (``-B``), ``preexec_fn``, a new session or process group, or an environment whose
import-time variables differ from the server's (``PYTHONHASHSEED`` and the rest of
``PYTHON*``, ``JAX_*``, ``TORCH*``, thread-count and allocator variables: Python, torch and
JAX read them as they start). Where a test is about the interpreter itself (how it ends, a
signal, a program with no file frame below it) it uses ``subprocess``.
"""

import atexit
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading

# Read while torch, JAX or the interpreter start: a child must not inherit the server's.
_AT_START = re.compile(r"(PYTHON(?!PATH$)|JAX_|TORCH|PYTORCH|OMP_|MKL_|KMP_|GOMP|OPENBLAS|LD_|MALLOC|TF_|TPU_)")
PRELOAD = ("numpy", "torch", "torch._dynamo", "torch.distributed.tensor", "jax", "jax.numpy",
            "jaxlib.mlir.dialects.mhlo")  # fmt: skip


def run(*popenargs, input=None, capture_output=False, timeout=None, check=False, **kwargs):
    """``subprocess.run`` with ``Popen`` below."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with Popen(*popenargs, **kwargs) as p:
        try:
            stdout, stderr = p.communicate(input, timeout=timeout)
        except BaseException:
            p.kill()
            p.wait()
            raise
        code = p.poll()
    if check and code:
        raise subprocess.CalledProcessError(code, p.args, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(p.args, code, stdout, stderr)


class Popen(subprocess.Popen):
    """``subprocess.Popen`` whose Python child is forked by the warm server when it can be."""

    _conn = None

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group):  # fmt: skip
        env = dict(os.environ if env is None else env)
        plain = not (shell or executable or preexec_fn or pass_fds or start_new_session or gid or gids or uid)
        plain = plain and umask < 0 and (process_group is None or process_group < 0)
        command = _command(args) if plain else None
        server = _Server.get() if command is not None else None
        if server is not None and server.stands_for(env):
            fds = [mine if mine != -1 else std for mine, std in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2))]
            request = {"command": command, "cwd": os.fspath(cwd or os.getcwd()), "env": env}
            try:
                self._conn, self._reply = server.fork(request, fds), b""
                self.pid = int(self._line())
                self._child_created = True
                self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
                return
            except (OSError, ChildProcessError):  # the server is gone (killed?): real interpreters from now on
                server.proc = self._conn = None
        super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                               creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                               restore_signals, gid, gids, uid, umask, start_new_session, process_group)  # fmt: skip

    def _line(self, block=True):
        """The server's next line (the pid, then the wait status), or None if not yet there."""
        self._conn.setblocking(block)
        while b"\n" not in self._reply:
            try:
                data = self._conn.recv(64)
            except BlockingIOError:
                return None
            if not data:
                raise ChildProcessError(f"the process server lost child {getattr(self, 'pid', '?')}")
            self._reply += data
        line, self._reply = self._reply.split(b"\n", 1)
        return line

    def _try_wait(self, wait_flags):
        if self._conn is None:
            return super()._try_wait(wait_flags)
        status = self._line(block=not wait_flags & os.WNOHANG)
        if status is None:
            return 0, 0
        self._conn.close()
        return self.pid, int(status)

    def _internal_poll(self, _deadstate=None, **_):
        if self._conn is None:
            return super()._internal_poll(_deadstate)
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    pid, status = self._try_wait(os.WNOHANG)
                    if pid == self.pid:
                        self._handle_exitstatus(status)
            except OSError:
                if _deadstate is not None:
                    self.returncode = _deadstate
            finally:
                self._waitpid_lock.release()
        return self.returncode


def _same_start(env, server_env) -> bool:
    """Whether ``env`` and the server's agree on every variable read as an interpreter starts."""
    keys = {k for k in set(env) | set(server_env) if _AT_START.match(k)}
    return all(env.get(k) == server_env.get(k) for k in keys)


def _command(args):
    """``(warnings, mode, target, argv, orig_argv)`` of ``[sys.executable, *options, -c/-m/path,
    ...]``, or None for a command the server cannot run."""
    if isinstance(args, (str, bytes)) or not args or os.fspath(args[0]) != sys.executable:
        return None
    rest = [os.fspath(a) for a in args[1:]]
    orig, warnings = [sys.executable, *rest], []
    same = set(subprocess._args_from_interpreter_flags()) - {"-W"}  # options this Python already has (-B)
    while rest and (rest[0].startswith("-W") or rest[0] in same):
        if rest[0] in same:
            rest = rest[1:]
        elif rest[0] == "-W":
            if len(rest) < 2:
                return None
            warnings.append(rest[1])
            rest = rest[2:]
        else:
            warnings.append(rest[0][2:])
            rest = rest[1:]
    if not rest or (rest[0].startswith("-") and rest[0] not in ("-c", "-m")):
        return None
    if rest[0] in ("-c", "-m"):
        if len(rest) < 2:
            return None
        return warnings, rest[0], rest[1], [rest[0], *rest[2:]], orig
    return warnings, "path", rest[0], rest, orig


class _Server:
    """The warm parent of this test process (None where it could not start)."""

    _one = None
    _lock = threading.Lock()

    @classmethod
    def get(cls):
        with cls._lock:
            if cls._one is None or cls._one.pid != os.getpid():
                cls._one = cls()
            return cls._one if cls._one.proc is not None else None

    def __init__(self):
        self.pid = os.getpid()
        self.env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        folder = tempfile.mkdtemp(prefix="xlatorch-warm-")
        atexit.register(shutil.rmtree, folder, True)
        self.path = os.path.join(folder, "server")
        try:
            self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), self.path], env=self.env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
            ready = self.proc.stdout.readline()
        except OSError:
            ready = b""
        if ready.strip() != b"ready":
            self.proc = None

    def stands_for(self, env) -> bool:
        """Whether a child of this server, given ``env``, starts as a fresh interpreter would."""
        return _same_start(env, self.env)

    def fork(self, request, fds):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        socket.send_fds(conn, [json.dumps(request).encode()], fds)
        conn.shutdown(socket.SHUT_WR)
        return conn


# ---- the server (run as ``python tests/warm.py SOCKET``) --------------------------------------


def _serve(path):
    import importlib
    import selectors

    start_env = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    # What the imports put in the environment (TF_CPP_MIN_LOG_LEVEL ...), as they would in a child.
    added = {k: v for k, v in os.environ.items() if k not in start_env}
    base = sys.path[1:]  # the interpreter's own path, without this file's folder
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(sys.stdin, selectors.EVENT_READ, "parent")  # closed when the test process ends
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        for key, _ in sel.select():
            if key.data == "parent":
                return
            if key.data == "accept":
                conn, _ = listener.accept()
                msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                while True:  # the rest of the request
                    more = conn.recv(1 << 20)
                    if not more:
                        break
                    msg += more
                pid = os.fork()
                if pid == 0:  # none of the server's descriptors stay open in the child
                    for other in list(sel.get_map().values()):
                        if isinstance(other.data, tuple):
                            os.close(other.fd)
                            other.data[1].close()
                    sel.close()
                    listener.close()
                    conn.close()
                    _child(json.loads(msg), fds, base, {**start_env, **added}, added)  # never returns
                for fd in fds:
                    os.close(fd)
                conn.sendall(b"%d\n" % pid)
                sel.register(os.pidfd_open(pid), selectors.EVENT_READ, (pid, conn))
            else:
                pid, conn = key.data
                sel.unregister(key.fileobj)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                try:
                    conn.sendall(b"%d\n" % status)
                except OSError:
                    pass  # the test process stopped waiting
                conn.close()


class _Exec(BaseException):
    """``os.execve`` of this Python in a child: unwinds the program, which ``_child`` replaces."""

    def __init__(self, command, env):
        self.command, self.env = command, env


def _child(request, fds, base, server_env, added):
    """Become the fresh interpreter the request names, run it, and end as it would."""
    import atexit
    import signal
    import warnings

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    modules, execve = set(sys.modules), os.execve
    filters = list(warnings.filters)  # as torch's and JAX's imports left them

    def exec_here(path, args, env):
        """``os.execve``: of this Python, for a command a fresh child could run, in place (as the
        ``xlatorch.compat`` runner does): the modules imported since the fork are dropped."""
        command = _command(args) if os.fspath(path) == sys.executable else None
        if command is None or not _same_start(env, server_env):
            execve(path, args, env)
        raise _Exec(command, dict(env))

    os.execve = exec_here
    os.chdir(request["cwd"])
    command, env = request["command"], request["env"]
    while True:
        try:
            code = _run_as_main(command, {**added, **env}, base, filters)
            break
        except _Exec as e:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            for name in set(sys.modules) - modules:
                del sys.modules[name]
            command, env = e.command, e.env
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        if code == -signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            sys.stderr.flush()
            code = 1
        os._exit(code & 0xFF)


def _run_as_main(command, env, base, filters):
    """Run ``command`` as a fresh ``python`` in this process's directory; its exit code (or the
    ``SystemExit`` argument, or ``-SIGINT``). Raises ``_Exec`` when the program execs Python."""
    import random
    import runpy
    import signal
    import types
    import warnings

    try:
        os.environ.clear()
        os.environ.update(env)
        warnings_opts, mode, target, argv, sys.orig_argv = command
        sys.argv = list(argv)
        first = "" if mode == "-c" else (os.getcwd() if mode == "-m" else os.path.dirname(os.path.abspath(target)))
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [first, *[os.path.abspath(p) for p in extra], *base]
        warnings.filters[:] = filters
        warnings._filters_mutated()
        sys.warnoptions[:] = warnings_opts
        warnings._processoptions(warnings_opts)
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        tempfile.tempdir = None
        if "multiprocessing.process" in sys.modules:
            mp = sys.modules["multiprocessing.process"]
            mp.ORIGINAL_DIR = os.getcwd()
            mp.current_process().authkey = os.urandom(32)
        main = types.ModuleType("__main__")
        main.__dict__.update(__builtins__=sys.modules["builtins"], __spec__=None, __package__=None)
        sys.modules["__main__"] = main
        if mode == "-c":
            exec(compile(target, "<string>", "exec", dont_inherit=True), main.__dict__)
        elif mode == "-m":
            runpy._run_module_as_main(target)
        else:
            main.__file__ = path = os.path.abspath(target)  # absolute, as Python 3.9+ makes it
            with open(path, "rb") as f:
                source = f.read()
            exec(compile(source, path, "exec", dont_inherit=True), main.__dict__)
    except _Exec:
        raise
    except SystemExit as e:
        return e.code
    except BaseException as e:
        e.__traceback__ = e.__traceback__.tb_next  # the traceback starts at the program's frames
        sys.excepthook(type(e), e, e.__traceback__)
        return -signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1
    return 0


if __name__ == "__main__":
    _serve(sys.argv[1])
