"""SIGINT and SIGTERM for the command line: any command ends the same way at any moment.

``cli.main`` calls :func:`install` first, before the heavy imports. From then on:

- **SIGINT** (Ctrl-C) raises :class:`Interrupted` and **SIGTERM** :class:`Terminated`, both
  ``KeyboardInterrupt`` subclasses, so every ``finally``, context manager and ``except KeyboardInterrupt``
  cleans up the same way for both (temporary files removed, worker pools ended); ``cli.main`` then prints
  one line (``tokenmill: interrupted`` / ``tokenmill: terminated``) and exits 130 / 143.
- A **second** signal while that clean-up runs ends the process at once: its multiprocessing children
  are killed, the same one line is written if it was not yet, and the exit code is the first signal's.
  Never a traceback, never a wait on a clean-up that hangs.
- Every **forked child** (the tokenizer pool of ``prepare``, DataLoader workers) ignores SIGINT, which a
  terminal sends to the whole process group, and takes SIGTERM's default action: its parent ends it.
  A signal that reaches a child before its fork hook ran finds the handler knowing it is not in the
  process that installed it, and acts as the worker would. The tokenizer pool also calls :func:`quiet_worker` in its initializer (for a ``spawn`` start); DataLoader
  workers started by ``spawn``/``forkserver`` end quietly on ``KeyboardInterrupt`` in torch's worker loop.
- A signal that arrives while a module is being **imported** is held until the import is over and then
  acts as above (a second one meanwhile ends the process at once): raised inside an import, the exception
  can cross a C++ extension's start-up (triton's, which ``torch.compile`` loads on first use), and the C++
  runtime then aborts the process with SIGABRT and a core dump. Imports end within seconds.
- A main thread **stuck in native code** that never returns (a collective whose peer died, a device sync,
  a lock) cannot run a Python handler at all. A watcher thread reads the interpreter's signal wake-up pipe
  (its C handler writes each signal's number there at once): when a SIGINT/SIGTERM has not been answered
  and the main thread has not run a line for ``STUCK_S`` (10 s), it ends the process with the signal's
  exit code and the line ``tokenmill: interrupted (no answer for 10 s: stuck in native code, ended
  without clean-up)``. Files are written atomically (``atomic.py``), so what it cannot clean up is a
  temporary sibling, never a damaged file.
- An object the exception left **half-built** (a library constructor interrupted between starting
  something and recording it) may fail in its ``__del__``; after a signal such an "Exception ignored in"
  report is the signal's consequence, not news, and is dropped (before any signal, and in processes that
  never had one, Python's report is unchanged). What must not stop half-way is built inside
  :func:`deferred` instead (the tokenizer pool, a DataLoader's workers).
- Inside :func:`graceful` (a training loop past its first step) the **first** signal raises nothing: it is
  recorded (:func:`requested`) for the loop to poll at its step boundaries, where it takes it (:func:`take`),
  stops in its own way (saves, says how to resume) and raises :func:`exception`. Not taken within the grace
  time, the signal raises as above; a second signal ends the process at once, as above. Once a signal is
  recorded, a child's death (a DataLoader worker killed by the same SIGTERM sent to the whole group) no
  longer raises in the middle of a step or a save (torch's SIGCHLD check is dropped: the process is stopping).
- After the command (``finish``, in a process that ``cli.main`` owns), a late signal during the
  interpreter's exit ends the process at once, quietly, with the command's exit code.
- A closed stdout pipe (``tokenmill sample | head -1``) exits 141 without a message (:func:`broken_pipe`).

The interpreter's own start-up, before ``cli.main`` runs its first line (about 30 ms), is Python's:
there a Ctrl-C is Python's ``KeyboardInterrupt`` and a SIGTERM its default (an immediate exit).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Optional


class Interrupted(KeyboardInterrupt):
    """SIGINT arrived (exit 130). A subclass, not ``KeyboardInterrupt`` itself: CPython flags an exact
    ``KeyboardInterrupt`` that crosses code run by ``PyRun_String`` (C++ extensions' start-up snippets) as
    unhandled and then kills its own process with SIGINT at exit, even after ``cli.main`` handled it."""


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: unwinds as Ctrl-C does (a ``KeyboardInterrupt``), exits 143."""


SIGNALS = (signal.SIGINT, signal.SIGTERM)
CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
WORDS = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}

_state: dict = {"active": False, "first": None, "announced": False, "quit": False, "previous": None,
                "pid": None, "code": None, "defer": 0, "held": None, "import_held": None, "redeliver": False,
                "answered": 0, "arrived": 0, "wakeup": None, "unraisable": None, "grace": None}
_hooks = False
_watcher: dict = {"pid": None, "w": -1}
STUCK_S = 10.0  # a signal the main thread has not answered for this long, without running a line: it is stuck


def _handler(signum: int, frame) -> None:
    _state["answered"] += 1  # the watcher's proof that the main thread runs
    if _state["quit"]:  # the command has ended and said so: exit with its code, nothing more to say
        force_exit(signum, _state["code"], announce=False)
    if os.getpid() != _state["pid"]:  # a forked child before its fork hook ran: act as a worker
        quiet_worker()
        if signum == signal.SIGTERM:
            os._exit(CODES[signum])  # it has done nothing yet
        return
    if _state["grace"] is not None and _graceful(signum):
        return
    if _state["defer"] and _state["first"] is None:
        if _state["held"] is not None:  # the second one: end now
            force_exit(_state["held"])
        _state["held"] = signum
        return
    if _state["redeliver"]:  # the held signal, sent again now that the import is over
        _state.update(redeliver=False, import_held=None)
    elif _state["import_held"] is not None:  # a second signal while the first waits for an import: end now
        force_exit(_state["import_held"])
    if _forking(frame):  # raised in a fork hook, the exception is lost and the hook's lock stays taken
        threading.Timer(0.02, os.kill, (os.getpid(), signum)).start()  # (logging's): send it again later
        return
    if _state["first"] is None and _inside(frame, _import_code()):
        _state["import_held"] = signum  # raised inside an import, it may cross a C++ extension's start-up,
        threading.Thread(target=_redeliver_after_import, args=(signum,), daemon=True).start()  # which aborts
        return
    if _state["first"] is None:
        _state["first"] = signum
        raise Terminated() if signum == signal.SIGTERM else Interrupted()
    force_exit(_state["first"])


def _graceful(signum: int) -> bool:
    """Inside :func:`graceful`: record the first signal and start its grace timer (True: nothing more to
    do); a second one ends the process. False: the grace time is over, the signal raises as usual."""
    g = _state["grace"]
    if g["escalate"]:  # sent by the grace timer
        g["escalate"] = False
        if g["taken"]:  # taken meanwhile: nothing to do
            return True
        _state["grace"] = None  # the usual path from here on
        return False
    if _state["first"] is not None or _state["import_held"] is not None or _state["redeliver"]:
        return False
    if g["requested"] is not None:  # a second signal before the loop took the first: end now
        force_exit(g["requested"])
    g.update(requested=signum, at=time.monotonic())
    if hasattr(signal, "SIGCHLD"):  # a DataLoader worker killed by the same SIGTERM (sent to the whole group)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # raises no more mid-step or mid-save (this process is
        # stopping); the loader still fails if it needs that worker's next batch
    g["timer"] = threading.Timer(g["grace_s"], _escalate, (g,))
    g["timer"].daemon = True
    g["timer"].start()
    return True


def _escalate(g: dict) -> None:
    """The grace time is over and the loop has not taken the signal: send it again, to raise."""
    if _state["grace"] is g and not g["taken"]:
        g["escalate"] = True
        os.kill(os.getpid(), g["requested"])


@contextlib.contextmanager
def graceful(grace_s: float) -> Iterator[None]:
    """Inside, the first SIGINT/SIGTERM raises nothing: :func:`requested` gives it to code that polls at safe
    points (a training loop's step boundary) and then calls :func:`take`. Not taken within ``grace_s``
    seconds, it raises as usual (``Interrupted``/``Terminated``); a second signal ends the process at once.
    One still pending when the body ends raises then. Where :func:`install` did not run (``train()`` called
    from Python), or in another thread, nothing changes."""
    if not _state["active"] or _state["pid"] != os.getpid() or _state["first"] is not None or \
            threading.current_thread() is not threading.main_thread():
        yield
        return
    g = {"grace_s": grace_s, "requested": None, "at": None, "taken": False, "timer": None, "escalate": False}
    _state["grace"] = g
    pending = False
    try:
        yield
    finally:
        if _state["grace"] is g:
            _state["grace"] = None
        if g["timer"] is not None:
            g["timer"].cancel()
        if g["requested"] is not None and not g["taken"] and _state["first"] is None:
            _state["first"] = pending = g["requested"]  # the exit code is the signal's, whatever ends the body
    if pending:
        raise exception(pending)


def requested() -> Optional[int]:
    """The signal :func:`graceful` holds for the code to take (None: none)."""
    g = _state["grace"]
    return g["requested"] if g is not None and not g["taken"] else None


def waited() -> float:
    """Seconds since the signal :func:`requested` gives arrived (0.0: none)."""
    g = _state["grace"]
    return time.monotonic() - g["at"] if g is not None and g["at"] is not None else 0.0


def take(signum: Optional[int] = None) -> int:
    """Take the held signal (or, in a process that received none, ``signum``: another rank's) and stop its
    grace timer: from now on a signal ends the process at once. Returns the signal to exit with."""
    g = _state["grace"]
    held = g["requested"] if g is not None else None
    if g is not None:
        g["taken"] = True
        if g["timer"] is not None:
            g["timer"].cancel()
    signum = held or signum or signal.SIGINT
    if _state["first"] is None:
        _state["first"] = signum
    return _state["first"]


def exception(signum: int) -> KeyboardInterrupt:
    """The exception a signal raises: :class:`Terminated` for SIGTERM, :class:`Interrupted` otherwise."""
    return Terminated() if signum == signal.SIGTERM else Interrupted()


def _forking(frame) -> bool:
    """Whether ``frame`` runs inside multiprocessing's ``Process.start`` (the fork, the at-fork hooks the
    interpreter runs around it, and the bookkeeping that lets the parent end the child later)."""
    mod = sys.modules.get("multiprocessing.process")
    start = getattr(getattr(mod, "BaseProcess", None), "start", None)
    return _inside(frame, getattr(start, "__code__", None))


def _import_code():
    """The code of the import system's ``_find_and_load``: on the stack while a module is first loaded."""
    return getattr(getattr(sys.modules.get("_frozen_importlib"), "_find_and_load", None), "__code__", None)


def _inside(frame, code) -> bool:
    while frame is not None and code is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _redeliver_after_import(signum: int) -> None:
    """Wait (in a thread) until the main thread has left every import, then send the held signal again.
    An exception raised while a module loads can cross native code that cannot carry it (a C++ extension
    whose start-up runs Python, e.g. triton's when torch.compile is first touched): the C++ runtime then
    aborts the whole process (SIGABRT, a core dump) instead of unwinding. Imports end within seconds."""
    main_id, code = threading.main_thread().ident, _import_code()
    while _inside(sys._current_frames().get(main_id), code):
        time.sleep(0.01)
    _state["redeliver"] = True
    os.kill(os.getpid(), signum)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM while the body runs (something that must not stop half-way, e.g. a pool
    being built, whose workers only the finished pool can end); a signal that came raises at the end."""
    _state["defer"] += 1
    try:
        yield
    finally:
        _state["defer"] -= 1
    held, _state["held"] = _state["held"], None
    if held is not None and _state["defer"] == 0 and _state["first"] is None:
        _state["first"] = held
        raise Terminated() if held == signal.SIGTERM else Interrupted()


_cleanups: list = []  # run by force_exit before it ends the process (see cleanup_on_force_exit)


@contextlib.contextmanager
def cleanup_on_force_exit(fn) -> Iterator[None]:
    """While the body runs, a process ended at once (a second signal, a stuck main thread) calls ``fn()``
    first: a quick removal of what the body was writing (its temporary files), so nothing is left behind."""
    _cleanups.append(fn)
    try:
        yield
    finally:
        _cleanups.remove(fn)


def force_exit(signum: int, code: Optional[int] = None, announce: bool = True, why: str = "",
               flush: bool = True) -> None:
    """End the process now: kill its multiprocessing children, run the :func:`cleanup_on_force_exit`
    functions, write the one line once (``why`` in brackets after it), flush what can be flushed, exit with
    ``code`` (default: the signal's; no other clean-up, no traceback)."""
    try:
        import multiprocessing

        for child in multiprocessing.active_children():
            child.kill()
    except Exception:  # noqa: BLE001 - ending anyway
        pass
    for fn in list(_cleanups):
        with contextlib.suppress(Exception):
            fn()
    if announce and not _state["announced"]:
        _state["announced"] = True
        os.write(2, f"tokenmill: {WORDS.get(signum, 'interrupted')}{f' ({why})' if why else ''}\n".encode())
    for stream in (sys.stdout, sys.stderr) if flush else ():
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a broken pipe or a write this signal interrupted
            pass
    os._exit(code if code is not None else CODES.get(signum, 128 + signum))


def received() -> Optional[int]:
    """The first SIGINT/SIGTERM received since :func:`install`, held by :func:`graceful` or not (None: none)."""
    return _state["first"] or requested()


def outcome(exc: BaseException) -> tuple[int, str]:
    """(exit code, the one line) for a command ended by ``exc`` after a signal or a KeyboardInterrupt."""
    signum = received() or (signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)
    _state["announced"] = True
    return CODES[signum], f"tokenmill: {WORDS[signum]}"


def install() -> None:
    """SIGINT/SIGTERM raise (see the module doc), forked children stay quiet. Main thread only; elsewhere
    (a command run from a thread) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return
    _install_process_hooks()
    _state.update(first=None, announced=False, quit=False, active=True, pid=os.getpid(), defer=0, held=None,
                  import_held=None, redeliver=False, previous={s: signal.getsignal(s) for s in SIGNALS},
                  answered=0, arrived=0, wakeup=_start_watcher(), grace=None)
    if sys.unraisablehook is not _unraisable:
        _state["unraisable"] = sys.unraisablehook
        sys.unraisablehook = _unraisable
    for s in SIGNALS:
        signal.signal(s, _handler)


def finish(owned: bool, code: Optional[int] = None) -> None:
    """After the command (exit ``code``; None: it raised): in a process ``cli.main`` owns, a late signal
    ends it at once with that code (quit mode); otherwise (``main([...])`` called from Python) the
    previous handlers come back."""
    if not _state["active"] or threading.current_thread() is not threading.main_thread():
        return
    if owned:
        _state.update(quit=True, code=code)
        return
    for s, h in (_state["previous"] or {}).items():
        signal.signal(s, h if h is not None else signal.SIG_DFL)
    if _state["wakeup"] is not None:
        with contextlib.suppress(ValueError, OSError):
            signal.set_wakeup_fd(_state["wakeup"])  # the caller's, usually none (-1)
    if sys.unraisablehook is _unraisable:
        sys.unraisablehook = _state["unraisable"] or sys.__unraisablehook__
    _state.update(active=False, quit=False, wakeup=None, unraisable=None)


def _unraisable(report) -> None:
    """Python's hook for an exception it cannot raise (a finalizer's): dropped once this process has
    received a SIGINT/SIGTERM (see the module doc); otherwise the hook that was there before."""
    if _state["first"] is not None and _state["pid"] == os.getpid():
        return
    (_state["unraisable"] or sys.__unraisablehook__)(report)


def quiet_worker() -> None:
    """In a worker process: SIGINT ignored (the parent decides); SIGTERM (the parent's way of ending it)
    removes the multiprocessing temporary folder this process made (a DataLoader worker's ``pymp-*``) and
    exits at once (nothing waits on a queue whose reader has stopped). Not ``SIG_IGN`` for SIGINT: a
    program this process execs gets the default back."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, _ignore)
    signal.signal(signal.SIGTERM, _worker_exit)
    _state.update(active=False, first=None, quit=False, grace=None)


def _ignore(signum: int, frame) -> None:
    pass


def _worker_exit(signum: int, frame) -> None:
    try:
        from multiprocessing import util

        remove = getattr(util, "_remove_temp_dir", None)
        for fin in list(getattr(util, "_finalizer_registry", {}).values()):  # this process's own only
            if remove is not None and getattr(fin, "_callback", None) is remove:
                fin()
    except Exception:  # noqa: BLE001 - ending anyway
        pass
    os._exit(CODES[signal.SIGTERM])


def _last_exit_step() -> None:
    """Registered first, so the interpreter runs it after every other exit function: in a process
    ``cli.main`` owns, ignore a signal from here on. Python gives caught signals their default action
    back while it tears down, and a signal in those last milliseconds would otherwise end the process
    by the signal itself instead of with the command's exit code."""
    if _state["quit"] and threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, signal.SIG_IGN)


def _install_process_hooks() -> None:
    global _hooks
    if _hooks:
        return
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_child)
    atexit.register(_last_exit_step)
    _hooks = True


def _after_fork_child() -> None:
    if _watcher["pid"] is not None:  # the parent's watcher pipe is not this process's (its thread did not fork)
        with contextlib.suppress(ValueError, OSError):
            signal.set_wakeup_fd(-1)
    if _state["active"]:
        quiet_worker()


def _start_watcher() -> Optional[int]:
    """Point the interpreter's signal wake-up at a pipe read by a watcher thread (one per process) and
    return the wake-up fd it had before (None where it cannot be set). The interpreter writes a signal's
    number to that pipe from its C handler, even while the main thread is blocked in native code (a stuck
    collective, a device sync, a lock): the only place a Python handler cannot run."""
    if _watcher["pid"] != os.getpid():
        r, w = os.pipe()
        os.set_blocking(w, False)
        _watcher.update(pid=os.getpid(), w=w)
        threading.Thread(target=_watch, args=(r,), name="tokenmill-signal-watcher", daemon=True).start()
    try:
        return signal.set_wakeup_fd(_watcher["w"], warn_on_full_buffer=False)
    except (ValueError, OSError):
        return None


def _watch(r: int) -> None:
    """Count SIGINT/SIGTERM as they arrive; when the main thread has answered fewer than have come and
    has not run a single line for ``STUCK_S`` seconds, it is stuck in native code that never returns
    (its Python handler cannot run): end the process, children included, with the signal's exit code."""
    while True:
        try:
            data = os.read(r, 256)
        except OSError:
            return
        ours = [b for b in data if b in CODES]
        if not ours or not _state["active"] or _state["pid"] != os.getpid():
            continue
        _state["arrived"] += len(ours)
        _await_answer(ours[0])


def _await_answer(signum: int) -> None:
    main_id, seen, since = threading.main_thread().ident, None, time.monotonic()
    while _state["active"] and _state["answered"] < _state["arrived"]:
        frame = sys._current_frames().get(main_id)
        where = (id(frame), frame.f_lasti if frame is not None else None)  # no reference kept: no locals held
        if where != seen:  # the main thread moved
            seen, since = where, time.monotonic()
        elif time.monotonic() - since >= STUCK_S:
            force_exit(_state["first"] or signum, why=f"no answer for {STUCK_S:.0f} s: stuck in native code, "
                       "ended without clean-up", flush=False)
        del frame
        time.sleep(0.05)


BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a Unix tool whose reader closed the pipe


def broken_pipe() -> int:
    """stdout's reader has gone (``tokenmill sample | head -1``): point stdout at the null device so the
    interpreter's exit flush stays quiet (Python's documented recipe) and exit 141, as ``seq`` or ``yes``
    would under ``set -o pipefail``; no message (the reader asked for no more)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (a test's capture)
        pass
    return BROKEN_PIPE
