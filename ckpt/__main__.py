"""``python -m ckpt`` and the ``ckpt`` console script."""

import os
import sys


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM while the CLI loads: as Ctrl-C (the command group takes over from there)


def main() -> None:
    import signal

    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _stop)
    try:
        from ckpt.cli.main import main as run
    except (
        KeyboardInterrupt
    ):  # Ctrl-C while the CLI's modules load, before its group can report it (cli/group.py)
        sys.stderr.write("ckpt: interrupted\n")
        sys.stderr.flush()
        os._exit(130)  # at once: a module whose import was cut short can fail again at interpreter exit
    run()


if __name__ == "__main__":
    main()
