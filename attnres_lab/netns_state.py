"""The state directory of the several-hosts harness (`attnres_lab.netns_cluster`), and the files in
it, held to the rules of the harness's doc: it runs as root, so nothing in that directory is taken
from anyone else. A directory is checked by lstat before every use (a directory, not a symlink,
owned by this euid, mode 0700, every directory above it root's or this euid's and not writable by
others unless sticky); a file is created with O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600, and read with
O_NOFOLLOW; what state.json names is checked against what `up` makes before anything acts on it.
Standard library only.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import stat
from pathlib import Path


class HarnessError(Exception):
    """Bad input or a state the command cannot act on: printed as one `error:` line, exit 2."""


def _private_problem(st: os.stat_result) -> str | None:
    """Why a directory, as lstat saw it, is not one only this euid can reach; None if it is."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not {os.geteuid()}"
    if st.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}: group or others can reach it (want 0700)"
    return None


def _check_ancestors(directory: Path) -> None:
    """Every directory from / down to `directory` (a resolved path): a real directory, owned by root
    or this euid, not writable by group or others unless sticky (as /tmp): no one else can swap a
    component."""
    for path in [*reversed(directory.parents), directory]:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise HarnessError(f"{path} does not exist: make it first (or use the default state dir)") from None
        why = ("is a symlink" if stat.S_ISLNK(st.st_mode) else "is not a directory" if not stat.S_ISDIR(st.st_mode)
               else f"is owned by uid {st.st_uid}" if st.st_uid not in (0, os.geteuid())
               else f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}) and not sticky"
               if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX else None)
        if why:
            raise HarnessError(f"state dir {directory}: {path} {why}: refusing it")


def create_private(path: Path, text: str | None = None) -> int:
    """A new file, 0600, never through a symlink nor over anything already there. With `text`:
    written and closed (returns -1); without: its open fd, for the caller to close."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise HarnessError(f"{path} exists already (left over, or planted): refusing to write through it; "
                           "run `down`, or remove it after looking") from None
    if text is not None:
        with os.fdopen(fd, "w") as file:
            file.write(text)
        return -1
    return fd


def read_private(path: Path) -> str:
    """A file of the state dir, never through a symlink."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        if isinstance(error, FileNotFoundError):
            raise
        raise HarnessError(f"{path}: {os.strerror(error.errno)} (a symlink?): refusing to read it") from None
    with os.fdopen(fd) as file:
        return file.read()


class State:
    """The state dir: checked before every use (see the module's doc), made by `up` only.
    `private_parent`: the parent is the harness's own (STATE_ROOT), made 0700 and held to the same
    checks as the dir."""

    def __init__(self, directory: str, private_parent: bool = False, prefix: str | None = None) -> None:
        path = Path(os.path.abspath(directory))
        if path.name in ("", ".", ".."):
            raise HarnessError(f"--state-dir {directory!r} must name a directory")
        # A symlink above it (as /var/run) is resolved once, so that it cannot be moved later; the
        # harness's own parent (STATE_ROOT) is not resolved: it, too, is checked by lstat.
        above = path.parent.parent if private_parent else path.parent
        self.dir = Path(os.path.realpath(above)) / path.relative_to(above)
        self.file = self.dir / "state.json"
        self.private_parent = private_parent
        self.prefix = prefix  # the cluster's prefix when the command line says it, else None

    def check(self, create: bool = False) -> bool:
        """True if the dir exists and passes; False if it does not exist (made first when `create`);
        HarnessError if it, or a directory above it, fails."""
        parent = self.dir.parent
        if self.private_parent:
            _check_ancestors(parent.parent)
            if create:
                try:
                    os.mkdir(parent, 0o700)
                except FileExistsError:
                    pass
            try:
                why = _private_problem(os.lstat(parent))
            except FileNotFoundError:
                return False
            if why:
                raise HarnessError(f"{parent} {why}: refusing it (remove it, or give --state-dir)")
        else:
            _check_ancestors(parent)
        if create:
            try:
                os.mkdir(self.dir, 0o700)
            except FileExistsError:
                pass
        try:
            st = os.lstat(self.dir)
        except FileNotFoundError:
            return False
        why = _private_problem(st)
        if why:
            raise HarnessError(f"state dir {self.dir} {why}: refusing it (remove it, or give another --state-dir)")
        return True

    def load(self) -> dict | None:
        if not self.check():
            return None
        try:
            text = read_private(self.file)
        except FileNotFoundError:
            return None
        try:
            state = json.loads(text)
        except ValueError as error:
            raise HarnessError(f"{self.file} is not JSON ({error}): remove it after looking") from None
        check_state(state, self)
        return state

    def save(self, state: dict) -> None:
        if not self.check():
            raise HarnessError(f"state dir {self.dir} is gone")
        tmp = self.dir / f"state.json.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        create_private(tmp, json.dumps(state, indent=2))
        os.replace(tmp, self.file)

    def require(self) -> dict:
        state = self.load()
        if state is None:
            raise HarnessError(f"no cluster in {self.dir}: run `up` first (or give its --prefix or --state-dir)")
        return state


def check_state(state: dict, store: State) -> None:
    """What state.json names must be exactly what `up` makes for its prefix, in this dir: else
    nothing is acted on (a planted or damaged file could name eth0, or any path)."""
    bad = []
    prefix = state.get("prefix") if isinstance(state, dict) else None
    if not isinstance(prefix, str) or not valid_prefix(prefix):
        raise HarnessError(f"{store.file}: prefix {prefix!r} is not one `up` takes: refusing to act on it")
    if store.prefix is not None and prefix != store.prefix:
        bad.append(f"prefix {prefix!r} (this cluster's is {store.prefix!r})")
    if state.get("dir") != str(store.dir):
        bad.append(f"dir {state.get('dir')!r}")
    if state.get("auth_token_path") != str(store.dir / "auth_token"):
        bad.append(f"auth_token_path {state.get('auth_token_path')!r}")
    if state.get("bridge") != f"{prefix}br":
        bad.append(f"bridge {state.get('bridge')!r}")
    hosts = state.get("hosts")
    if not isinstance(hosts, list) or not 1 <= len(hosts) <= 50:
        bad.append("hosts (not a list of 1-50)")
        hosts = []
    for index, host in enumerate(hosts):
        if not isinstance(host, dict):
            bad.append(f"host {index}")
            continue
        for key, want in (("name", host_name(prefix, index)), ("veth", veth_name(prefix, index))):
            if host.get(key) != want:
                bad.append(f"host {index}'s {key} {host.get(key)!r}")
        pid = host.get("pid")
        if pid is not None and (type(pid) is not int or pid <= 1):
            bad.append(f"host {index}'s pid {pid!r}")
        try:
            ipaddress.ip_address(host.get("ip"))
        except ValueError:
            bad.append(f"host {index}'s ip {host.get('ip')!r}")
    if bad:
        raise HarnessError(f"{store.file} names what this harness does not make ({', '.join(bad)}): refusing to "
                           f"act on it; look, then remove {store.dir} and what it made by hand")


def valid_prefix(prefix: str) -> bool:
    return prefix.isascii() and prefix.isalnum() and 1 <= len(prefix) <= 8


def host_name(prefix: str, index: int) -> str:
    return f"{prefix}-h{index}"


def veth_name(prefix: str, index: int) -> str:
    return f"{prefix}v{index}"


def open_log(directory: Path, name: str) -> int:
    """A fresh `name`.log in the state dir (an earlier one, of a restarted node, renamed to
    .log.old: a rename moves a symlink itself, never what it points at); returns its fd."""
    log = directory / f"{name}.log"
    try:
        os.replace(log, directory / f"{name}.log.old")
    except FileNotFoundError:
        pass
    return create_private(log)
