"""A free local TCP port (a rendezvous for one process, the test pools, the local SLURM's daemons).

    python -c "from distlab.ports import free_port; print(free_port())"
"""

import socket


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago (the OS picks it; another process may take it first)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
