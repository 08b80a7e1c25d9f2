"""Run our command lines (python train.py, sample.py, convert.py, -m torch.distributed.run, -c CODE) as real
processes, forked from one that has already imported torch: each `python train.py` of the tests spent ~4.5 s of its
~7 s importing, on one core. torchrun's launcher, run here, forks its workers in the same way (forked_worker below)
instead of starting a cold `python -u train.py` each: a 2-rank run of 10 steps took 23 s of CPU, 2 of them training.

The child is a real process: its own pid, the given argv, environment and working directory, fds 1 and 2 to files,
the script run as __main__ by runpy, and an uncaught exception or SystemExit ends it as the interpreter ends any
script (a traceback or the message on stderr, the exit status). What it shares with its parent is only the state
after the imports (torch's thread count included: the server runs with OMP_NUM_THREADS=1, as the tests' runs do).
An import-time failure of a script would not show here: tests/test_train.py's other launches start it cold, and so
do the torchrun launches that tests/test_checkpoint.py, test_train.py and test_scripts.py (SLURM) make themselves.

Protocol: one JSON line a request on stdin, one JSON line back on stdout: {"jobs": [{argv, env, cwd, stdout, stderr,
timeout}], "parallel": n} runs them and answers their exit statuses in job order; {"spawn": job} starts one and
answers {"pid": pid} at once (spawn(): a test that signals it or waits for what it writes), {"poll": pid} answers its
{"status"}, null while it runs."""

import atexit
import faulthandler
import gc
import json
import os
import random
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
PATH = sys.path[1:]  # as `python script.py` has it, after the script's own folder


def child(job, reply_fd):
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, reply_fd):  # the child reads nothing, and cannot write into the replies
        os.dup2(null, fd)
    for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    signal.alarm(int(job["timeout"]))  # a hung run dies with SIGALRM (status -14) instead of hanging the suite
    argv = job["argv"]
    if argv[:2] == ["-m", "torch.distributed.run"]:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

        global handler_popen
        handler_popen = subprocess_handler.SubprocessHandler._popen  # for a worker command that is not `python -u`
        subprocess_handler.SubprocessHandler._popen = forked_worker
    run_script(argv, job["cwd"])


def run_script(argv, cwd):
    """What `python ARGV...` runs, in this process."""
    if argv[0] == "-m":  # python -m module args: sys.argv[0] becomes the module's file, sys.path[0] the cwd
        sys.argv, sys.path[:] = [argv[1], *argv[2:]], [cwd, *PATH]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":  # python -c code args
        sys.argv, sys.path[:] = ["-c", *argv[2:]], ["", *PATH]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        sys.argv, sys.path[:] = list(argv), [str(Path(argv[0]).resolve().parent), *PATH]
        runpy.run_path(argv[0], run_name="__main__")


class Worker:
    """The part of a subprocess.Popen that torchrun's SubprocessHandler uses, for a worker this process forked."""

    def __init__(self, pid):
        self.pid, self.returncode = pid, None

    def poll(self):
        if self.returncode is None and (done := os.waitpid(self.pid, os.WNOHANG))[0]:
            self.returncode = os.waitstatus_to_exitcode(done[1])
        return self.returncode

    def wait(self, timeout=None):
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


handler_popen = None  # torch's SubprocessHandler._popen, set where child() replaces it with forked_worker
AT_EXIT = []  # the atexit handlers the server's imports registered: a cold interpreter's imports register them too
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM)


def forked_worker(handler, args, env):
    """torchrun's SubprocessHandler._popen(args=(python, -u, script, ...), env): the worker forked from the launcher
    (its imports done) where Popen(args, env=env, start_new_session=True) would start a cold interpreter. Returns once
    the worker is set up as an exec'd one would be: its own session, default signal handlers (signals blocked until
    then), the atexit handlers of the imports but none of the launcher's, fresh random seeds, fds 1 and 2 to the
    handler's files if it has them. It ends with os._exit, so that the launcher's own stack (its finally blocks, which
    stop workers) never unwinds in it. Not as a cold start: Python's string hashes are the launcher's on every rank
    (an order of a set of str that differs between ranks shows only in the cold torchrun launches), it holds the
    launcher's other fds (its store's sockets), and its command line in /proc is the fork server's."""
    if argv_of(args) is None:
        return handler_popen(handler, args, env)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    ready_r, ready_w = os.pipe()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    pid = os.fork()
    if pid:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        os.close(ready_w)
        os.read(ready_r, 1)  # set up (or dead): Popen returns after the exec too
        os.close(ready_r)
        return Worker(pid)
    code, interrupted = 1, False
    try:
        os.close(ready_r)
        os.setsid()
        for sig in SIGNALS:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        atexit._clear()
        weakref.finalize._registered_with_atexit = False
        for func, a, kw in AT_EXIT:
            atexit.register(func, *a, **kw)
        if not env.get("PYTHONFAULTHANDLER"):
            faulthandler.disable()  # torchrun's @record enabled it in the launcher
        random.seed()
        torch.seed()
        np.random.seed()
        for fd, file in ((1, handler._stdout), (2, handler._stderr)):
            if file is not None:
                os.dup2(file.fileno(), fd)
        os.environ.clear()
        os.environ.update(env)
        os.write(ready_w, b"1")
        os.close(ready_w)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        run_script(argv_of(args), os.getcwd())
        code = 0
    except SystemExit as e:  # as the interpreter ends on one: its code, or its message on stderr and 1
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:  # the interpreter ends by SIGINT (status -2), after its atexit handlers
        traceback.print_exc()
        interrupted = True
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            threading._shutdown()  # the interpreter's exit: non-daemon threads joined, then atexit, then streams
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            if interrupted:
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
        finally:
            os._exit(code)


def argv_of(args):
    """`python -u script args...` as torchrun starts a worker: [script, args...]; None for another command."""
    return list(args[2:]) if len(args) > 2 and args[0] == sys.executable and args[1] == "-u" else None


def serve():
    sys.path.insert(0, str(ROOT))
    register = atexit.register
    atexit.register = lambda func, *a, **kw: AT_EXIT.append((func, a, kw)) or register(func, *a, **kw)
    import sentencepiece  # noqa: F401  what train.py, sample.py and convert.py import at start or first use
    import torch._dynamo  # noqa: F401  what building a model on the meta device imports first (~1.6 s of a 3 s run)

    import convert  # noqa: F401
    import sample  # noqa: F401
    import train  # noqa: F401

    atexit.register = register

    gc.freeze()  # the imports stay out of the children's garbage collections: fewer copy-on-write pages

    reply = os.fdopen(os.dup(1), "w")
    spawned = {}  # pid -> exit status (None while it runs) of the children started by {"spawn"}

    def fork(job):
        reply.flush()
        # safe to fork only while this process runs one thread: a fork copies the locks other threads hold
        threads = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else [None]
        if len(threads) != 1:
            raise RuntimeError(f"tests/forkserver.py runs {len(threads)} threads: a fork could copy a lock one holds")
        pid = os.fork()
        if pid == 0:
            child(job, reply.fileno())
            sys.exit(0)  # the script returned: exit as the interpreter does (atexit handlers, flushed streams)
        return pid

    def reap():
        """The next child to end: (pid, its exit status); a spawned one's is kept for its poll."""
        pid, code = os.wait()
        if pid in spawned:
            spawned[pid] = os.waitstatus_to_exitcode(code)
        return pid, os.waitstatus_to_exitcode(code)

    for line in sys.stdin:
        request = json.loads(line)
        if "spawn" in request:
            spawned[pid := fork(request["spawn"])] = None
            answer = {"pid": pid}
        elif "poll" in request:
            pid = request["poll"]
            if pid not in spawned:  # a child of a server that has died since
                answer = {"error": f"pid {pid} is no child of this fork server"}
            else:
                if spawned[pid] is None and (done := os.waitpid(pid, os.WNOHANG))[0]:
                    spawned[pid] = os.waitstatus_to_exitcode(done[1])
                answer = {"status": spawned[pid]}
        else:
            jobs, running, status = request["jobs"], {}, {}
            for i, job in enumerate(jobs):
                while len(running) >= request["parallel"]:
                    pid, code = reap()
                    if pid in running:
                        status[running.pop(pid)] = code
                running[fork(job)] = i
            while running:
                pid, code = reap()
                if pid in running:
                    status[running.pop(pid)] = code
            answer = [status[i] for i in range(len(jobs))]
        reply.write(json.dumps(answer) + "\n")
        reply.flush()


# -----------------------------------------------------------------------------
# the client side, in the pytest process

_server = None


def start():
    """Start the server (its imports take a few seconds; tests/conftest.py starts it with the session)."""
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   text=True, cwd=ROOT, env=os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        atexit.register(stop, _server)


def stop(server):
    server.stdin.close()  # the server ends at EOF; waited for, so that its CPU time counts as ours
    server.wait(timeout=60)


def ask(request):
    _server.stdin.write(json.dumps(request) + "\n")
    _server.stdin.flush()
    line = _server.stdout.readline()
    if not line:
        raise RuntimeError(f"tests/forkserver.py died (exit status {_server.wait()})")
    return json.loads(line)


def job(cmd, env, cwd, folder, name, timeout):
    assert cmd[0] == sys.executable, cmd
    if env.get("OMP_NUM_THREADS") != "1":
        raise ValueError("the fork server's children run torch with one thread: pass OMP_NUM_THREADS=1")
    return {"argv": [str(a) for a in cmd[1:]], "env": dict(env), "cwd": str(cwd), "stdout": str(folder / f"{name}.out"),
            "stderr": str(folder / f"{name}.err"), "timeout": timeout}


def run_many(cmds, env, cwd=ROOT, timeout=300, parallel=1):
    """Run each cmd ([sys.executable, script | -m module | -c code, *args]) in a child of the server, `parallel` at a
    time; a list of subprocess.CompletedProcess (text stdout, stderr) as subprocess.run(..., capture_output=True) gives."""
    start()
    tmp = Path(tempfile.mkdtemp(prefix="forkserver-"))
    jobs = [job(cmd, env, cwd, tmp, i, timeout) for i, cmd in enumerate(cmds)]
    results = [subprocess.CompletedProcess(cmd, code, Path(j["stdout"]).read_text(errors="replace"),
                                           Path(j["stderr"]).read_text(errors="replace"))
               for cmd, j, code in zip(cmds, jobs, ask({"jobs": jobs, "parallel": parallel}))]
    shutil.rmtree(tmp, ignore_errors=True)
    return results


def run(cmd, env, cwd=ROOT, timeout=300):
    return run_many([cmd], env, cwd, timeout)[0]


class Spawned(Worker):
    """A command started by spawn(): what the tests use of a subprocess.Popen with text stdout and stderr pipes (a
    Worker whose exit status the server collects, and communicate); its output is read when it has ended."""

    def __init__(self, cmd, env, cwd, timeout):
        start()
        self.folder = Path(tempfile.mkdtemp(prefix="forkserver-"))
        self.job = job(cmd, env, cwd, self.folder, "spawned", timeout)
        super().__init__(ask({"spawn": self.job})["pid"])

    def poll(self):
        if self.returncode is None:
            answer = ask({"poll": self.pid})
            if "error" in answer:
                raise RuntimeError(answer["error"])
            self.returncode = answer["status"]
        return self.returncode

    def communicate(self, timeout=None):
        self.wait(timeout)
        out, err = (Path(self.job[k]).read_text(errors="replace") for k in ("stdout", "stderr"))
        shutil.rmtree(self.folder, ignore_errors=True)
        return out, err


def spawn(cmd, env, cwd=ROOT, timeout=300):
    """Start cmd in a child of the server and return at once (a Spawned)."""
    return Spawned(cmd, env, cwd, timeout)


if __name__ == "__main__":
    serve()
