import sys

from tokenmill.cli import main


def _exit(code) -> None:
    """End the process once the command has succeeded (exit code 0): flush the streams, run the exit functions
    (atexit: logging, multiprocessing children, weakref finalizers), then ``os._exit(0)``, skipping the
    interpreter's teardown, which frees every module torch loaded one by one (about 1.5 s of CPU after a
    training run, in every rung, probe and rank a bench or torchrun starts). Where that teardown could still
    matter (a command that failed or was interrupted, a thread that is not a daemon still running, a stream
    that cannot be flushed) the usual exit runs instead."""
    import atexit
    import os
    import threading

    if code != 0 or any(
            t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        raise SystemExit(code)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # a closed pipe: Python's own exit reports it as it does
        raise SystemExit(code) from None
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # what an exit function printed to a closed pipe: lost either way
            pass
    os._exit(0)


if __name__ == "__main__":
    # a pipe's stderr writes each piece of a print on its own (write-through, unbuffered): the newline apart from
    # its line, so the lines of two ranks sharing torchrun's stderr could join. One write per line instead.
    if hasattr(sys.stderr, "reconfigure"):
        sys.stderr.reconfigure(line_buffering=True, write_through=False)
    _exit(main())
