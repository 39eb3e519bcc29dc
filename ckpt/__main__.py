"""``python -m ckpt`` and the ``ckpt`` console script."""

import sys


def main() -> None:
    try:
        from ckpt.cli.main import main as run
    except (
        KeyboardInterrupt
    ):  # Ctrl-C while the CLI's modules load, before its group can report it (cli/group.py)
        sys.stderr.write("ckpt: interrupted\n")
        sys.exit(130)
    run()


if __name__ == "__main__":
    main()
