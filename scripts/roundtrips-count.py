#!/usr/bin/env python3
"""Counts the system calls one stowage command makes on the store's files,
the way the contract counts server round trips: opens, closes, locks and
unlocks (flock, and SQLite's fcntl locks), fsyncs, stats, reads, directory
reads, renames/unlinks/mkdirs, setattrs, extended attributes (NFS 4.2
sends each). Buffered writes are shown but not
counted. A lock the kernel releases for us counts as an unlock (closing a
locked descriptor, or exiting with it open), and a regular file still open at
exit counts as a close: so `flock -s LOCK true` counts exactly 4. Closing a
directory is not counted: an NFS client sends nothing for it (directories
are not opened on the server; only the open's lookup and attribute check
go there, and those are counted).

usage: roundtrips-count.py ROOT[:IMAGES_DIR] STRACE_LOG [--list]
       (IMAGES_DIR: an images directory outside the root, counted too)
       (the log from `strace -f -y -o STRACE_LOG ...`)
Prints one JSON object: {"total": N, "by_category": {...}}; with --list,
every counted call first.
"""
import collections
import json
import os
import re
import sys

CATEGORIES = {
    "open": {"open", "openat", "openat2", "creat"},
    "close": {"close"},
    "fsync": {"fsync", "fdatasync", "syncfs", "sync_file_range"},
    "stat": {"stat", "lstat", "fstat", "newfstatat", "statx", "statfs", "fstatfs",
             "access", "faccessat", "faccessat2", "readlink", "readlinkat"},
    "read": {"read", "pread64", "readv", "preadv", "preadv2"},
    "dirread": {"getdents", "getdents64"},
    "namespace": {"rename", "renameat", "renameat2", "unlink", "unlinkat", "mkdir", "mknod", "mknodat",
                  "mkdirat", "rmdir", "link", "linkat", "symlink", "symlinkat"},
    "setattr": {"fchown", "fchmod", "fchownat", "fchmodat", "chmod", "chown", "lchown",
                "ftruncate", "truncate", "utimensat", "futimesat", "fallocate"},
    "write": {"write", "pwrite64", "writev", "pwritev"},
    "xattr": {"getxattr", "lgetxattr", "fgetxattr", "setxattr", "lsetxattr", "fsetxattr",
              "listxattr", "llistxattr", "flistxattr", "removexattr", "lremovexattr",
              "fremovexattr"},
}
NOT_COUNTED = {"write"}
CALL = re.compile(r"^(\d+)\s+(?:<\.\.\. (\w+) resumed>|(\w+)\()(.*)$")


def main():
    dirs = [os.path.realpath(d).rstrip("/") for d in sys.argv[1].split(":")]
    root = dirs[0]
    lines = open(sys.argv[2]).read().splitlines()
    listing = "--list" in sys.argv
    under = lambda p: any(p == d or p.startswith(d + "/") for d in dirs)
    fdpath = {}          # (pid, fd) -> path, from strace's -y annotations
    open_fds = {}        # main process: fd -> path of store files open
    dir_fds = set()      # main process: those of them opened as directories
    locked = set()       # main process: fds holding a flock
    main_pid = None
    counted = []         # (category, call, path)

    def add(cat, call, path):
        shown = path.replace(root, "ROOT")
        for d in dirs[1:]:
            shown = shown.replace(d, "IMAGES")
        counted.append((cat, call, shown))

    unfinished = {}      # pid -> (call, its first half), while another thread's call ran
    for line in lines:
        m = CALL.match(line)
        if not m:
            continue
        pid = m.group(1)
        if m.group(3) and "<unfinished ...>" in m.group(4):
            unfinished[pid] = (m.group(3), m.group(4).replace("<unfinished ...>", ""))
            continue
        if m.group(2):
            # "<... flock resumed>) = 0": the call's arguments are in its first half.
            name, head = unfinished.pop(pid, (m.group(2), ""))
            rest = head + m.group(4)
        else:
            name, rest = m.group(3), m.group(4)
        if main_pid is None:
            main_pid = pid
        if name == "exit_group" and pid == main_pid:
            for fd, p in sorted(open_fds.items()):
                if os.path.isdir(p):
                    continue
                if fd in locked:
                    add("unlock", "(exit)", p)
                add("close", "(exit)", p)
            continue
        paths = [p for d in dirs for p in re.findall(r"<(" + re.escape(d) + r"[^>]*)>", rest)]
        for q in re.findall(r'"(/[^"]*)"', rest):
            fdref = re.match(r"/proc/self/fd/(\d+)(.*)", q)
            if fdref and (pid, fdref.group(1)) in fdpath:
                paths.append(fdpath[(pid, fdref.group(1))] + fdref.group(2))
            elif under(q):
                paths.append(q)
        result = re.search(r"= (\d+)<([^>]*)>", rest)
        if result:
            fdpath[(pid, result.group(1))] = result.group(2)
            if pid == main_pid and under(result.group(2)) and name in CATEGORIES["open"]:
                open_fds[result.group(1)] = result.group(2)
                if "O_DIRECTORY" in rest or os.path.isdir(result.group(2)):
                    dir_fds.add(result.group(1))
                else:
                    dir_fds.discard(result.group(1))
        first_fd = re.match(r"(\d+)<", rest)
        if pid == main_pid and first_fd:
            fd = first_fd.group(1)
            if name == "close" and fd in open_fds:
                path = open_fds.pop(fd)
                if fd in locked:
                    locked.discard(fd)
                    add("unlock", "(close)", path)
                if fd in dir_fds:
                    dir_fds.discard(fd)
                    continue
            if name == "flock" and rest.rstrip().endswith("= 0"):
                if "LOCK_UN" in rest:
                    locked.discard(fd)
                else:
                    locked.add(fd)
        if not paths:
            continue
        cat = None
        if name == "flock":
            cat = "unlock" if "LOCK_UN" in rest else "lock"
        elif name == "fcntl":
            if re.search(r"F_(OFD_)?SETLKW?|F_(OFD_)?GETLK", rest):
                cat = "unlock" if "F_UNLCK" in rest else "lock"
        else:
            cat = next((c for c, calls in CATEGORIES.items() if name in calls), None)
        if cat is not None:
            add(cat, name, paths[0])
    by_cat = collections.Counter(c for c, _, _ in counted)
    total = sum(n for c, n in by_cat.items() if c not in NOT_COUNTED)
    if listing:
        for cat, call, path in counted:
            mark = " " if cat in NOT_COUNTED else "*"
            print(f"{mark} {cat:9} {call:12} {path}", file=sys.stderr)
    print(json.dumps({"total": total, "by_category": dict(sorted(by_cat.items()))}))


if __name__ == "__main__":
    main()
