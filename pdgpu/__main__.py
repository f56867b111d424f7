"""`python -m pdgpu` and the `pdgpu` command: the engine command line."""

import sys


def _load(interrupt):
    """(pdgpu.cli.main, None), or (None, the interrupt that stopped its import)."""
    stop = None
    try:
        from pdgpu.cli import main
        return main, interrupt.received()  # an import may have swallowed what it raised
    except KeyboardInterrupt as e:
        stop = e
    except BaseException:  # after a signal, whatever an import cut short raised is its
        if interrupt.received() is None:  # (numpy half imported: a RecursionError later)
            raise
    return None, interrupt.received() or stop


def run() -> int:
    """The command line; Ctrl-C or SIGTERM while it loads (torch: a second or two) is one line
    too, and an interrupted run ends without the interpreter's exit (pdgpu/interrupt.py)."""
    from pdgpu import interrupt

    previous = interrupt.install()
    main, stop = _load(interrupt)
    if stop is not None:
        print(f"pdgpu: {interrupt.describe(stop)} while starting", file=sys.stderr)
        interrupt.restore(previous)
        return interrupt.exit_code(stop)
    code = main()
    if code in (130, 143):
        interrupt.finish(code)
    interrupt.stop_helpers()  # no process of the run outlives the command
    interrupt.restore(previous)
    return code


if __name__ == "__main__":
    sys.exit(run())
