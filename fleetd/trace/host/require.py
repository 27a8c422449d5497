"""What tracing needs beyond the client's install, checked before anything starts.

Every command but those in :data:`NODE_COMMANDS` is a client command: it installs with
``pip``/``pipx`` and never imports BCC. ``fleetd agent`` and ``fleetd trace`` need
BCC's Python module, which comes from the OS (Debian's ``python3-bpfcc``, never the
unrelated PyPI name ``bcc``), and the ``agent`` extra (pyelftools). Without them they
stop here with one line and how to install them, before a port is bound or a database
file is created.
"""

from __future__ import annotations

from fleetd.errors import TraceError

# The commands that trace (the demo starts agents); every other one is the client's.
NODE_COMMANDS = ("trace", "agent", "demo")

BCC_HINT = (
    "install BCC from the OS: sudo apt-get install python3-bpfcc libbpfcc (Debian, "
    "Ubuntu), then run fleetd from a venv that sees it (python3 -m venv "
    "--system-site-packages, or scripts/setup.sh in a checkout); `pip install bcc` is an "
    f"unrelated package. Every command but {', '.join(NODE_COMMANDS[:-1])} and "
    f"{NODE_COMMANDS[-1]} needs none of this"
)
EXTRA_HINT = "pip install 'fleetd[agent]' (the node side's Python dependencies)"


def require_tracing(command: str) -> None:
    """Raise :class:`TraceError` (one line and a hint) when ``command`` (``fleetd
    agent``, ``fleetd trace``) could not trace on this install."""
    try:
        import bcc  # noqa: F401
    except ImportError as exc:
        raise TraceError(f"{command} needs BCC's Python module, which is not installed "
                         f"here ({exc})", BCC_HINT) from exc
    except OSError as exc:  # the module is there, its libbcc is not
        raise TraceError(f"{command} needs libbcc, which BCC's Python module could not "
                         f"load ({exc})", BCC_HINT) from exc
    try:
        import elftools  # noqa: F401
    except ImportError as exc:
        raise TraceError(f"{command} needs pyelftools, which is not installed here ({exc})",
                         EXTRA_HINT) from exc
