"""Grammar compiles in child processes, each compile under a memory limit and a time limit.

A guided backend's compile can run for minutes and grow without bound on a spec a client chose
(a counted repetition such as ``a{99999999}``, a string of up to 20,000 characters in a JSON
schema). In a thread of the engine it could not be stopped at its time limit, and it took the
engine process down when memory ran out. A backend that offers an isolated compiler (see
:class:`runtime.structured_output.IsolatedCompileBackend`) has that part run here instead: in a
child process (``python -m runtime.scheduler.grammar_sandbox``) whose address space is capped
and which is killed when the compile's deadline passes. The child is kept for the next compile
while it stays healthy; a killed or crashed one is replaced on the next compile.

The child imports only what unpickling the compiler needs (the backend's compiler module should
not import torch). Parent and child speak over the child's stdin and stdout in frames: an 8-byte
little-endian length, then a pickle. The first frame is the compiler, a picklable callable
``compiler(kind, spec) -> artifact``; every later frame ``(kind, spec)`` is answered by
``("ok", artifact)``, ``("invalid", message)`` (the compiler raised ValueError: a bad spec),
``("memory", message)`` or ``("error", exception type, message)``.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<Q")
GIB = 1 << 30


class CompileTimeout(Exception):
    """The compile was still running at its deadline; its process was killed."""


class CompileOutOfMemory(ValueError):
    """The compile needed more memory than its limit (a property of the spec: compiling it again fails the same way)."""


class CompileFailed(RuntimeError):
    """The compiler raised something other than ValueError, or its process died for another reason."""


class CompileCancelled(Exception):
    """The compile was stopped through its :class:`CompileHandle` (no request waits for it any more)."""


class CompileHandle:
    """Lets another thread stop one :meth:`GrammarSandbox.compile`: :meth:`cancel` kills the child process
    running it, or keeps it from starting. The call then raises :class:`CompileCancelled`."""

    def __init__(self):
        self._lock = threading.Lock()
        self._child: _Child | None = None
        self.cancelled = False

    def _attach(self, child: _Child | None) -> bool:
        """The compile runs in ``child`` from now on (None: it ended); False if it was cancelled meanwhile."""
        with self._lock:
            self._child = child
            return not self.cancelled

    def cancel(self) -> None:
        with self._lock:  # under the lock: the child cannot go back to the idle ones meanwhile
            self.cancelled = True
            if self._child is not None:
                self._child.signal_kill()  # the compiling thread sees the pipe close, then reaps and closes it


class GrammarSandbox:
    """Runs ``compiler(kind, spec)`` in child processes: at most ``memory_limit`` bytes of address
    space beyond what the child holds once the compiler is loaded, killed at the deadline each call
    gives. Thread-safe: each concurrent call gets its own child."""

    def __init__(self, compiler, memory_limit: int):
        self.memory_limit = memory_limit
        self._compiler_frame = pickle.dumps(compiler, protocol=pickle.HIGHEST_PROTOCOL)
        self._lock = threading.Lock()
        self._idle: list[_Child] = []
        self._busy: set[_Child] = set()
        self._closed = False

    def compile(self, kind: str, spec: str, deadline: float, handle: CompileHandle | None = None) -> tuple[object, int]:
        """The artifact of ``compiler(kind, spec)`` and the bytes it took in the reply; or raises
        ValueError (a bad spec, including :class:`CompileOutOfMemory`), :class:`CompileTimeout`
        (``time.monotonic()`` passed ``deadline``), :class:`CompileCancelled` (through ``handle``) or
        :class:`CompileFailed`."""
        child = self._take()
        healthy = False
        try:
            if handle is not None and not handle._attach(child):
                healthy = True  # never asked: the child stays as it was
                raise CompileCancelled()
            reply, size = child.ask(pickle.dumps((kind, spec), protocol=pickle.HIGHEST_PROTOCOL), deadline)
            healthy = True
        except (CompileTimeout, CompileCancelled):
            raise
        except _ChildDied as died:
            if handle is not None and handle.cancelled:
                raise CompileCancelled() from None
            raise self._death_error(kind, died.returncode) from None
        finally:
            if handle is not None and not handle._attach(None):
                healthy = False  # cancelled: its child may have been killed
            self._give_back(child, healthy)
        status, *detail = reply
        if status == "ok":
            return detail[0], size
        if status == "invalid":
            raise ValueError(detail[0])
        if status == "memory":
            raise CompileOutOfMemory(self._memory_message(kind))
        raise CompileFailed(f"{detail[0]}: {detail[1]}")

    def _memory_message(self, kind: str) -> str:
        return (f"compiling this {kind} needed more than {self.memory_limit / GIB:g} GiB of memory "
                "(structured_output_compile_memory_bytes); simplify it, e.g. smaller repetition counts or maxLength")

    def _death_error(self, kind: str, returncode: int) -> Exception:
        # Running out of its address space ends a native allocator with abort() (Rust) or the
        # process is killed; Python's own MemoryError comes back as a "memory" reply instead.
        if returncode in (-signal.SIGABRT, -signal.SIGKILL, -signal.SIGSEGV, -signal.SIGBUS):
            return CompileOutOfMemory(self._memory_message(kind))
        return CompileFailed(f"the grammar compile process exited with status {returncode}")

    def _take(self) -> _Child:
        with self._lock:
            if self._closed:
                raise CompileFailed("the structured output manager is shut down")
            if self._idle:
                child = self._idle.pop()
                self._busy.add(child)
                return child
        try:  # a new process, started outside the lock (it reads the compiler first)
            child = _Child(self._compiler_frame, self.memory_limit)
        except _ChildDied as died:
            raise CompileFailed(f"the grammar compile process ended as it started (exit status {died.returncode})") from None
        with self._lock:
            self._busy.add(child)
            closed = self._closed
        if closed:
            self._give_back(child, healthy=False)
            raise CompileFailed("the structured output manager is shut down")
        return child

    def _give_back(self, child: _Child, healthy: bool) -> None:
        with self._lock:
            self._busy.discard(child)
            if healthy and not self._closed:
                self._idle.append(child)
                return
        child.kill()

    @property
    def num_processes(self) -> int:
        """Child processes alive now (idle and compiling)."""
        with self._lock:
            return len(self._idle) + len(self._busy)

    def close(self) -> None:
        """Kill every child; calls still running fail."""
        with self._lock:
            self._closed = True
            children, self._idle = self._idle + list(self._busy), []
        for child in children:
            child.kill()


class _ChildDied(Exception):
    def __init__(self, returncode: int):
        self.returncode = returncode


class _Child:
    """One compile process and its pipes."""

    def __init__(self, compiler_frame: bytes, memory_limit: int):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the modules the parent sees
        env["MALLOC_ARENA_MAX"] = "2"  # each glibc arena reserves 64 MiB of the capped address space
        env.pop("CUDA_VISIBLE_DEVICES", None)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "runtime.scheduler.grammar_sandbox", str(memory_limit)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True,
        )
        self._send(compiler_frame)

    def _send(self, payload: bytes) -> None:
        try:
            self.process.stdin.write(_HEADER.pack(len(payload)) + payload)
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            raise _ChildDied(self.process.wait()) from None

    def ask(self, payload: bytes, deadline: float) -> tuple[tuple, int]:
        """The child's reply to ``payload`` and its size in bytes."""
        self._send(payload)
        size = _HEADER.unpack(self._read(_HEADER.size, deadline))[0]
        return pickle.loads(self._read(size, deadline)), size

    def _read(self, size: int, deadline: float) -> bytes:
        fd = self.process.stdout.fileno()
        chunks, left = [], size
        while left:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                self.kill()
                raise CompileTimeout()
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                raise _ChildDied(self.process.wait())
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def signal_kill(self) -> None:
        """SIGKILL only, safe from another thread than the one reading the pipes (which then sees them end)."""
        if self.process.returncode is None:
            try:
                self.process.kill()
            except OSError:
                pass

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:
                pass


# ---------------------------------------------------------------------------- the child


def _read_frame(stream):
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None  # the parent closed the pipe (or died): exit
    return pickle.loads(stream.read(_HEADER.unpack(header)[0]))


def _write_frame(stream, value) -> None:
    payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(payload)) + payload)
    stream.flush()


def _limit_address_space(extra: int) -> None:
    """Cap this process's address space at what it maps now plus ``extra`` bytes (Linux; elsewhere
    the compile runs without a memory limit, still killed at its deadline)."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (ImportError, OSError):
        print("grammar sandbox: no /proc/self/statm here; compiles run without a memory limit", file=sys.stderr)
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = mapped + extra if hard == resource.RLIM_INFINITY else min(mapped + extra, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _answer(compiler, kind: str, spec: str):
    try:
        return ("ok", compiler(kind, spec))
    except MemoryError:
        return ("memory", "")
    except ValueError as exc:
        return ("invalid", str(exc))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - e.g. a Rust panic (pyo3's PanicException is a BaseException)
        return ("error", type(exc).__name__, " ".join(str(exc).split()))


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which kills its children
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # what the compiler prints must not enter the replies
    compiler = _read_frame(stdin)
    if compiler is None:
        return 0
    _limit_address_space(int(argv[0]))
    while (job := _read_frame(stdin)) is not None:
        reply = _answer(compiler, *job)
        try:
            _write_frame(stdout, reply)
        except MemoryError:  # pickling a huge artifact within the limit
            _write_frame(stdout, ("memory", ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
