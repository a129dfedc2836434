"""What the check_*.py scripts share: fail() reports a failed case and lets
the script go on with its other cases; finish() ends the script, with exit
status 1 when any case failed."""
import sys

_failures = 0


def fail(msg):
    global _failures
    print("FAIL:", msg)
    _failures += 1


def finish(summary=False):
    """Exits: 0 when no case failed, else 1; summary prints 'ok' or 'failed'
    first."""
    if summary:
        print("failed" if _failures else "ok")
    sys.exit(1 if _failures else 0)
