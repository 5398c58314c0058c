"""Where a webhook may go: https to public addresses only, unless the dispatcher allows
private ones. The name is resolved here, every address it gives checked, and the request
sent to the checked address (the name kept for TLS and Host): a name that resolves to a
public address for the check and to 127.0.0.1 for the connection (DNS rebinding) cannot
slip through."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit


class Refused(Exception):
    """A webhook URL this dispatcher will not call (the message says why, naming no path)."""


@dataclass(frozen=True)
class Target:
    """A URL resolved and checked: `url` names the address, `host` the name it came from."""

    url: str
    host: str  # the Host header
    sni: str | None  # the TLS server name (https), checked against the certificate


def public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Not loopback, private, link-local (the clouds' metadata address), shared, reserved,
    multicast or unspecified; an IPv6 address mapping an IPv4 one is judged as that one."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


async def resolve(url: str, allow_private: bool) -> Target:
    """The checked target of `url`; raises Refused."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise Refused("not an http(s) URL with a host")
    if parts.scheme != "https" and not allow_private:
        raise Refused("only https webhooks are allowed (--allow-private-webhooks for http)")
    host = parts.hostname
    port = parts.port or (443 if parts.scheme == "https" else 80)
    addresses = await _addresses(host, port)
    if not allow_private:
        bad = [str(a) for a in addresses if not public(a)]
        if bad:
            raise Refused(f"{host} resolves to a non-public address ({bad[0]})")
    pinned = addresses[0]
    shown = f"[{pinned}]" if pinned.version == 6 else str(pinned)
    netloc = f"{shown}:{port}"
    target = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
    sni = host if parts.scheme == "https" else None
    return Target(target, parts.netloc.rpartition("@")[2], sni)


async def _addresses(host: str, port: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise Refused(f"{host} does not resolve: {exc.strerror or exc}") from None
    if not infos:
        raise Refused(f"{host} does not resolve")
    return [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]


def shown(url: str) -> str:
    """A URL as logs and failure records show it: scheme, host and path, never its query
    (which may hold a receiver's token)."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))
