"""`python -m trnd` and the `trnd` script. Ctrl-C while Python is still importing the CLI exits 130 without a
traceback, as it does once the CLI runs (trnd/cli.py main)."""


def entry() -> int:
    try:
        from trnd.cli import main
    except KeyboardInterrupt:
        return 130
    return main()


if __name__ == "__main__":
    raise SystemExit(entry())
