import sys

from tokenmill.cli import main

if __name__ == "__main__":
    # a pipe's stderr writes each piece of a print on its own (write-through, unbuffered): the newline apart from
    # its line, so the lines of two ranks sharing torchrun's stderr could join. One write per line instead.
    if hasattr(sys.stderr, "reconfigure"):
        sys.stderr.reconfigure(line_buffering=True, write_through=False)
    raise SystemExit(main())
