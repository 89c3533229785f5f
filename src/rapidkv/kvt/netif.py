"""Which network interface holds an address, for transports that pick interfaces
by name (UCX: ``UCX_NET_DEVICES``) while rapidkv's settings name addresses.

Linux (and other systems with `getifaddrs(3)`): the interfaces' IPv4 and IPv6
addresses, secondary addresses included, read through ctypes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import os
import socket


class _Sockaddr(ctypes.Structure):
    _fields_ = (("sa_family", ctypes.c_ushort), ("sa_data", ctypes.c_ubyte * 14))


class _SockaddrIn(ctypes.Structure):
    _fields_ = (
        ("sin_family", ctypes.c_ushort),
        ("sin_port", ctypes.c_uint16),
        ("sin_addr", ctypes.c_ubyte * 4),
        ("sin_zero", ctypes.c_ubyte * 8),
    )


class _SockaddrIn6(ctypes.Structure):
    _fields_ = (
        ("sin6_family", ctypes.c_ushort),
        ("sin6_port", ctypes.c_uint16),
        ("sin6_flowinfo", ctypes.c_uint32),
        ("sin6_addr", ctypes.c_ubyte * 16),
        ("sin6_scope_id", ctypes.c_uint32),
    )


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = (
    ("ifa_next", ctypes.POINTER(_Ifaddrs)),
    ("ifa_name", ctypes.c_char_p),
    ("ifa_flags", ctypes.c_uint),
    ("ifa_addr", ctypes.POINTER(_Sockaddr)),
    ("ifa_netmask", ctypes.POINTER(_Sockaddr)),
    ("ifa_ifu", ctypes.POINTER(_Sockaddr)),
    ("ifa_data", ctypes.c_void_p),
)


def interface_addresses() -> dict[str, list[str]]:
    """Every interface of this network namespace with its IPv4/IPv6 addresses."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"getifaddrs: {os.strerror(err)}")
    out: dict[str, list[str]] = {}
    try:
        node = head
        while node:
            entry = node.contents
            name = (entry.ifa_name or b"").decode(errors="replace")
            addresses = out.setdefault(name, [])
            if entry.ifa_addr:
                family = entry.ifa_addr.contents.sa_family
                if family == socket.AF_INET:
                    raw = ctypes.cast(entry.ifa_addr, ctypes.POINTER(_SockaddrIn)).contents
                    addresses.append(str(ipaddress.IPv4Address(bytes(raw.sin_addr))))
                elif family == socket.AF_INET6:
                    raw6 = ctypes.cast(entry.ifa_addr, ctypes.POINTER(_SockaddrIn6)).contents
                    addresses.append(str(ipaddress.IPv6Address(bytes(raw6.sin6_addr))))
            node = entry.ifa_next
    finally:
        libc.freeifaddrs(head)
    return out


def resolve(host: str) -> set[str]:
    """The addresses `host` (a literal or a name) stands for, normalised."""
    try:
        return {str(ipaddress.ip_address(host.strip("[]")))}
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve {host!r}: {e}") from None
    return {str(ipaddress.ip_address(info[4][0])) for info in infos}


def interface_of(host: str, interfaces: dict[str, list[str]] | None = None) -> str:
    """The name of the interface holding `host`'s address (`interfaces`: as
    `interface_addresses` gives, read when None). ValueError naming what was
    looked for and what exists, when no interface holds it."""
    wanted = resolve(host)
    found = interface_addresses() if interfaces is None else interfaces
    for name, addresses in found.items():
        if wanted & {str(ipaddress.ip_address(a)) for a in addresses}:
            return name
    seen = ", ".join(f"{n} ({' '.join(a) or 'no address'})" for n, a in sorted(found.items()))
    raise ValueError(
        f"no network interface holds {host!r} ({', '.join(sorted(wanted))}) in this "
        f"network namespace; interfaces: {seen or 'none'}"
    )
