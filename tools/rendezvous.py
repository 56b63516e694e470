"""Rendezvous addresses the operating system chooses: no port is guessed.

Binding a socket to port 0, reading the number and closing the socket leaves a
window in which any other process on the machine can take that port before
the ranks bind it (a test once died with EADDRINUSE that way). A TCPStore made
with port 0 listens on the port the kernel picked and keeps it. The process
that makes it hosts the store for the ranks, as torchrun's agent does: with
TORCHELASTIC_USE_AGENT_STORE=True, every rank, rank 0 included, joins it as a
client through init_process_group's env:// or tcp:// rendezvous. From PyTorch
2.14 the flag holds only for the store at MASTER_ADDR:MASTER_PORT (for any
other address rank 0 tries to serve it and fails with EADDRINUSE), so a rank
joining a second hosted store points MASTER_PORT at it first.

    with hosted_stores() as (ports, env):
        start the ranks with env (MASTER_ADDR, MASTER_PORT and the agent flag)
"""

from __future__ import annotations

import contextlib
import datetime

HOST = "127.0.0.1"


@contextlib.contextmanager
def hosted_stores(count: int = 1, host: str = HOST, timeout: float = 600):
    """Hosts `count` stores on ports the OS picks, for as long as the block runs.

    Yields their ports and the environment that sends a rank's default
    rendezvous to the first one. One store serves one process group's
    rendezvous: a second group on the same store would read the first one's keys.
    """
    import torch.distributed as dist

    stores = [dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                            timeout=datetime.timedelta(seconds=timeout)) for _ in range(count)]
    try:
        env = {"MASTER_ADDR": host, "MASTER_PORT": str(stores[0].port),
               "TORCHELASTIC_USE_AGENT_STORE": "True"}
        yield [s.port for s in stores], env
    finally:
        stores.clear()
