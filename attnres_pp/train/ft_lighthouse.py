"""The torchft Lighthouse of a `--fault-tolerance replicas` run: the one the engine starts for the
job (with timeouts that make a lost group cost the others about a second), how many quorum
requests it holds, and the address ranks on other nodes reach it at."""

from __future__ import annotations

# The Lighthouse drops a group whose Manager has not heartbeaten for this long (the Managers beat
# every 100 ms), and forms a quorum without a group that has not asked for one this long after the
# first did: a lost group costs the others about a second, not torchft's 60 s defaults.
HEARTBEAT_TIMEOUT_MS = 1000
JOIN_TIMEOUT_MS = 1000
JOIN_LEAD_S = 0.3
JOIN_WAIT_S = 10.0


def lighthouse_requests(address: str) -> int | None:
    """How many quorum requests the Lighthouse at `address` holds, from its /status page ("only have N
    participants"); None when the page cannot be read or does not say."""
    import re
    import urllib.request

    try:
        with urllib.request.urlopen(f"{address.rstrip('/')}/status", timeout=1.0) as page:
            text = page.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
    found = re.search(r"only have (\d+) participants", text)
    return int(found.group(1)) if found else None


def at_host(url: str, host: str) -> str:
    """`url` with its host replaced by `host` (an address; IPv6 in brackets), its port and path kept."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def start_lighthouse(min_replicas: int):
    """(the server, its URL) of a Lighthouse serving on every interface of this host."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=JOIN_TIMEOUT_MS,
                              heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    return server, server.address()  # http://HOSTNAME:PORT
