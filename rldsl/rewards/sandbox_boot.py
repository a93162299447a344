"""The first code a sandboxed program runs (rldsl.rewards.sandbox).

It runs as ``python -I -c <this file's text> CONFIG``, so it imports nothing
of rldsl: the sandbox needs no path to the package. In order, it leaves the
network (a network namespace of its own, when the sandbox found that works),
sets the resource limits, gives up root for the sandbox's own user id (when
started as root), blocks Python's internet sockets with an audit hook (which
no later code can remove) and runs ``main.py`` of the working directory as
``__main__``.
"""

import ctypes
import json
import os
import resource
import runpy
import socket
import sys

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
_INTERNET = (socket.AF_INET, socket.AF_INET6)
_BLOCKED_CALLS = ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
                  "socket.gethostbyname", "socket.gethostbyaddr")


def leave_network(how: str) -> None:
    flags = {"namespace": CLONE_NEWNET, "user_namespace": CLONE_NEWUSER | CLONE_NEWNET}.get(how)
    if flags is None:
        return
    if ctypes.CDLL(None, use_errno=True).unshare(flags) != 0:
        sys.stderr.write(f"sandbox: cannot enter a network namespace (errno {ctypes.get_errno()})\n")
        os._exit(125)


def set_limits(limits: dict) -> None:
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value))


def become(uid) -> None:
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


def no_internet(event: str, args) -> None:
    if event == "socket.__new__" and args[1] in _INTERNET or event in _BLOCKED_CALLS and _internet(event, args):
        raise PermissionError(f"network access is disabled in the sandbox ({event})")


def _internet(event: str, args) -> bool:
    return not args or not isinstance(args[0], socket.socket) or args[0].family in _INTERNET


def main() -> None:
    config = json.loads(sys.argv[1])
    leave_network(config["network"])
    set_limits(config["limits"])
    become(config["uid"])
    sys.addaudithook(no_internet)
    sys.argv = ["main.py", *config["argv"]]
    sys.path.insert(0, os.getcwd())
    try:
        runpy.run_path("main.py", run_name="__main__")
    except MemoryError:
        sys.stderr.write("MemoryError: the sandbox's memory limit was reached\n")
        os._exit(1)


main()
