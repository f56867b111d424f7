"""`python -m pdgpu` and the `pdgpu` command: the engine command line."""

import sys


def run() -> int:
    """The command line; a Ctrl-C while it loads (torch: a second or two) is one line too."""
    try:
        from pdgpu.cli import main
    except KeyboardInterrupt:
        print("pdgpu: interrupted (Ctrl-C) while starting", file=sys.stderr)
        return 130
    return main()


if __name__ == "__main__":
    sys.exit(run())
