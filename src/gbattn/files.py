"""Files gbattn writes and reads: one atomic-write helper (temporary file, fsync, rename) used by
every writer (run directories, tokenizer and token caches, results), and JSON readers that turn a
bad file into a one-line error naming it. Nothing here imports the rest of gbattn at import time but its errors and
checks (portable_path looks up the corpus names gbattn knows when called)."""

from __future__ import annotations

import contextlib
import errno
import glob
import io
import itertools
import json
import math
import os
import re
import shlex
import shutil
import socket
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from gbattn.checks import near_miss
from gbattn.errors import CheckpointError, UserError


def error_detail(e: BaseException, limit: int = 80, with_type: bool = False) -> str:
    """The first line of an exception's message, at most ``limit`` characters, a cut one ending in "…"
    ("malformed" when it has none), with its type name in front if ``with_type``: the detail of a one-line error."""
    lines = str(e).splitlines()
    text = lines[0] if lines else "malformed"
    if len(text) > limit:  # "(the tokeni)" read as a whole message
        text = text[:limit - 1] + "…"
    return f"{type(e).__name__}: {text}" if with_type else text


# Write errors the user must fix: no space, a quota, a read-only file system, a file larger than the file system
# (FAT's 4 GiB) or a file-size limit (`ulimit -f`) allows.
FULL_DISK = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)


def full_disk_reason(error: BaseException | None, depth: int = 5) -> str | None:
    """Why a write failed, where the disk or a limit on it is the reason (full, over quota, read-only, a file over the
    size limit): an OSError's; the error text of safetensors' SafetensorError, which names the OS error it met
    ("I/O error: File too large (os error 27)"; "Os { code: 28, ... }" in some versions); datasets' own disk-space
    check ("Not enough disk space", an OSError of no errno); or, else, the error's cause or context (atomic_write's
    one line, a DatasetGenerationError over an OSError). None for another failure."""
    if error is None or depth == 0:
        return None
    if isinstance(error, OSError) and error.errno in FULL_DISK:
        return error.strerror
    code = re.search(r"\(os error (\d+)\)|\bOs \{ code: (\d+)", str(error))
    code = code and (code[1] or code[2])
    if code and int(code) in FULL_DISK:
        return os.strerror(int(code))
    if isinstance(error, OSError) and error.errno is None and str(error).startswith("Not enough disk space"):
        return "Not enough disk space"
    return full_disk_reason(error.__cause__ or error.__context__, depth - 1)


def create_new(path: Path) -> int:
    """A file descriptor, open for writing, of a new empty file at ``path`` (a temporary or probe file of a
    predictable name), replacing whatever was there: never through a link planted under that name in a shared
    directory (opening it would create or truncate the link's target, outside the directory)."""
    path.unlink(missing_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)


def atomic_write(path: str | Path, content: bytes | memoryview | str | Iterable[str]) -> None:
    """Write ``content`` (bytes, or text as UTF-8, or pieces of text written as they come) to ``path`` through a
    temporary file in the same directory, then rename it into place and sync the directory. On any failure (a full
    disk, a kill) the previous file stays and the temporary file is removed; a full disk is a one-line
    :class:`UserError` (that says the previous file is kept only where there was one), another failed write an
    :class:`OSError` naming ``path`` (the CLI prints it). Callers serialize first (``torch.save`` into
    ``io.BytesIO``, see ``rundir.save_checkpoint``): a library writing into the file itself could report the failed
    write as another exception."""
    atomic_write_all([(path, content)])


def atomic_write_all(files: list[tuple[str | Path, bytes | memoryview | str | Iterable[str]]]) -> None:
    """:func:`atomic_write` of several files that describe one another (lm-eval's results and its samples): every
    temporary file written first, then each renamed into place, so that a full disk leaves all the previous files,
    not some new ones beside old ones. Errors as :func:`atomic_write`'s, naming the file whose write failed."""
    staged: list[tuple[Path, Path]] = []
    path, replaced = None, 0
    try:
        for path, content in files:
            path = Path(path)
            tmp = path.with_name(path.name + building_suffix())  # whose it is: remove_abandoned removes it after a
            # kill (and so does the next write of the file: the folders of analyze, plot and bench take no lock and
            # were never cleaned, so each kill -9 during a write left one more gates.png.tmp<pid>@<host>)
            remove_abandoned(path.parent, path.name)
            staged.append((tmp, path))
            with open(create_new(tmp), "wb") as f:
                if isinstance(content, (bytes, bytearray, memoryview, str)):
                    f.write(content.encode("utf-8") if isinstance(content, str) else content)
                else:
                    for piece in content:
                        f.write(piece.encode("utf-8"))
                f.flush()
                os.fsync(f.fileno())
        for tmp, path in staged:
            os.replace(tmp, path)
            replaced += 1
        for folder in dict.fromkeys(path.parent for _, path in staged):
            sync_directory(folder)
    except BaseException as e:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno in FULL_DISK:
            kept = f"; the previous {path.name} is kept" if os.path.exists(path) else ""  # (never raises)
            if len(files) > 1 and not replaced:  # (the files written before it were only staged: each is as it was)
                kept = f"; it and the {len(files) - 1} other file(s) written with it are as they were"
            elif replaced:  # (a rename failed after others: rare, as a rename needs no room)
                kept = (f"; {replaced} of the {len(files)} files written together were replaced before it: "
                        f"{', '.join(p.name for _, p in staged[:replaced])}")
            raise UserError(f"could not write {path} ({e.strerror}){kept}") from None
        if isinstance(e, OSError) and e.filename is None:  # a failed write or sync names no file of itself
            e.filename = str(path)
        raise


def write_figure(fig, path: str | Path, **savefig_options) -> None:
    """A matplotlib figure through :func:`atomic_write`, in the format its name ends with: ``savefig`` into a
    file would follow a link at ``path`` (a shared run directory's ``analysis/gates.png``) and write elsewhere."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format=Path(path).suffix[1:], **savefig_options)
    atomic_write(path, buffer.getvalue())


def building_suffix() -> str:
    """The name suffix of a folder or file this process builds before renaming it into place (a token cache
    entry, an export's staging folder, :func:`atomic_write`'s temporary file): ``.tmp<pid>@<host>`` (a folder
    shared between machines holds other hosts' builds, whose pids mean nothing here)."""
    return f".tmp{os.getpid()}@{socket.gethostname()}"


def building_owner(name: str) -> tuple[str, str]:
    """The process id (text; digits for one of :func:`building_suffix`) and host a temporary name
    ``NAME.tmp<pid>@<host>`` names; the host is empty in ``NAME.tmp<pid>``, written before the host was named."""
    stem, at, host = name.rpartition("@")  # a host name holds no "@" but may hold ".tmp" (build.tmp-runner)
    return (stem if at else host).rsplit(".tmp", 1)[-1], host if at else ""


def remove_abandoned(directory: Path, name: str | None = None) -> None:
    """Delete the folders and files being built in ``directory`` on this host (``NAME.tmp<pid>@<host>``, of one
    ``name`` where given) by processes that no longer exist (killed with -9: a Ctrl-C or an error removes its own)."""
    pattern = f"{glob.escape(name)}.tmp*" if name is not None else "*.tmp*"
    for path in directory.glob(pattern) if directory.is_dir() else ():
        pid, host = building_owner(path.name)
        if not pid.isdigit() or host != socket.gethostname() or not process_gone(int(pid)):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:  # best effort (in a shared sticky folder, another user's file cannot be removed: the write goes on)
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)


def process_gone(pid: int) -> bool:
    """Whether no process of this id runs on this host: False for a live one (under any user) and for a number no
    pid can be (nothing is known of it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):  # alive under another user, or not a pid
        return False
    return False


def remove_unwritten(out_dir: Path, names: tuple[str, ...], written: list[Path]) -> list[str]:
    """Delete ``out_dir/NAME.png`` and ``.pdf`` of the figures ``names`` that this command draws but did
    not write this time (left by an earlier call: another run's gates, PDFs from an earlier --pdf),
    so the folder holds only figures of what it now describes; returns the file names removed."""
    removed = []
    for name in names:
        for path in (Path(out_dir) / f"{name}.png", Path(out_dir) / f"{name}.pdf"):
            if path.is_file() and path not in written:
                path.unlink()
                removed.append(path.name)
    return removed


def sync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a crash after it keeps the new name). Filesystems that
    cannot sync a directory are left as they are."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.EACCES):
            raise
    finally:
        os.close(fd)


def write_json(obj: Any, path: str | Path) -> None:
    """JSON (NaN and infinities written as null) through :func:`atomic_write`."""
    atomic_write(path, json_text(obj))


def write_report(json_path: Path, obj: Any, markdown: str) -> None:
    """A report's JSON and its Markdown rendering (results.json and results.md, bench.json and bench.md) replaced
    together (:func:`atomic_write_all`): a full disk under the second left the new JSON beside the previous Markdown."""
    atomic_write_all([(json_path, json_text(obj)), (json_path.with_suffix(".md"), markdown)])


def json_text(obj: Any) -> str:
    """The text :func:`write_json` writes: indented JSON, NaN and infinities as null, ending its line."""
    return json.dumps(finite(obj), indent=1) + "\n"


def finite(obj: Any) -> Any:
    """JSON-safe: NaN and infinities become None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def open_to_append(path: str | Path):
    """``path``, a regular file (created if new), opened as text to append to. Never through a link (it would
    write outside the run directory) and never into a directory or a FIFO (which would block): a one-line
    :class:`UserError` instead. A new file gets the umask's permissions, as every file gbattn writes."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    except OSError as e:  # "remove it" only for what is refused (a missing folder or no permission is not that)
        refused = e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO)  # a link, a directory, a FIFO (no reader)
        raise UserError(f"{path} cannot be opened to append to ({e.strerror or e}"
                        + ("; a link, a directory or a FIFO is refused): remove it" if refused else ")")) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a device
        os.close(fd)
        raise UserError(f"{path} is not a regular file: remove it")
    return open(fd, "a", encoding="utf-8")


def append_jsonl(path: str | Path, record: dict) -> None:
    """One JSON line appended to ``path`` (:func:`open_to_append`: a regular file, never through a link), whole or
    not at all: a write that fails (a full disk) cuts the file back to where it was, and a full disk is a one-line
    :class:`UserError` naming the file (it was "No space left on device", naming nothing, with half a line left)."""
    data = (json.dumps(finite(record)) + "\n").encode("utf-8")
    with open_to_append(path) as f:
        fd = f.fileno()  # (written through the descriptor: nothing left in the file object's buffer to fail again)
        size = os.fstat(fd).st_size
        try:
            written = 0
            while written < len(data):
                written += os.write(fd, data[written:])
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            if e.errno in FULL_DISK:
                raise UserError(f"could not append to {path} ({e.strerror}); its earlier lines are kept") from None
            if e.filename is None:
                e.filename = str(path)
            raise


def dangling_link(path: Path) -> str | None:
    """"a link to TARGET, which does not exist" where ``path`` is a link to nothing (a Hugging Face hub snapshot
    copied without its blobs, say); None otherwise."""
    if path.is_symlink() and not path.exists():
        try:
            os.stat(path)
        except OSError as e:
            if e.errno == errno.ELOOP:  # (links to each other: "a link to B, which does not exist" of a B that does)
                return f"a link to {os.readlink(path)} in a loop of links that lead back to each other"
        return f"a link to {os.readlink(path)}, which does not exist"
    return None


def refuse_linked_folder(path: Path, what: str, instead: str = "") -> None:
    """Refuse a folder that gbattn writes into or deletes from under a name of its own (a comparison's
    ``LABEL/seedN``, a run's ``analysis/`` and ``lm-eval/``, a comparison's ``figures/``) where that name is a
    symbolic link: one planted in a folder received from elsewhere sent runs, figures and deletions anywhere (README,
    "Trust: safe loading, one writer, clear errors"). A folder the user names (an ``--out``) may be a link: ``instead``
    names that option."""
    if path.is_symlink():
        raise UserError(f"{path} is a link to {os.readlink(path)}: gbattn writes {what} only into a folder of its "
                        f"own there, never through a link (it can lead anywhere); remove the link"
                        + (f", or give {instead}" if instead else ""))


def check_writable_dir(path: str | Path, what: str = "--out", create: bool = True) -> Path:
    """Prove a file can be written in directory ``path`` before long work starts: create it and
    write a probe file, or (``create=False``) probe the nearest existing parent without creating anything."""
    if not str(path).strip():
        raise UserError(f"{what} is empty: name a directory")
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{what} {path} is a file, not a directory")
    if link := dangling_link(path):  # mkdir would fail with "File exists"
        raise UserError(f"{what} {path} is {link}")
    target = path
    if not create:
        while not target.exists() and target != target.parent:
            target = target.parent
        if not target.is_dir():
            raise UserError(f"{what} {path}: {target} is a file, not a directory")
    try:
        target.mkdir(parents=True, exist_ok=True)
        probe = target / f".write-test{building_suffix()}"  # (whose it is: a kill leaves it to remove_abandoned)
        os.close(create_new(probe))
        probe.unlink()
    except OSError as e:
        raise UserError(f"{what} {path} is not writable ({e.strerror or e})") from None
    return path


def check_writable_file(path: str | Path, what: str) -> Path:
    """The parent directory of ``path`` exists and is writable, and ``path`` is not a directory, a device or a pipe
    (:func:`atomic_write` replaces what is there: `eval --per-token /dev/null` as root put a regular file in place
    of the machine's /dev/null)."""
    if str(path).endswith(("/", os.sep)):  # ("pt dir/" of a folder not there wrote a file named "pt dir")
        raise UserError(f"{what} {path} names a folder (it ends in /); give a file name")
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{what} {path} is a directory; give a file name")
    if path.exists() and not path.is_file():
        raise UserError(f"{what} {path} is a device or a pipe, which gbattn would replace with a file; give a file "
                        f"name")
    there = next((p for p in path.parents if p.exists()), Path("."))  # the nearest folder that is there
    if not there.is_dir():  # (the message named the parent as the option's value: "--per-token c/afile is a file")
        raise UserError(f"{what} {path}: {there} is a file, not a folder")
    check_writable_dir(path.parent if str(path.parent) else Path("."), what, create=False)
    # atomic_write writes NAME.tmp<pid>@<host> first: a name the folder takes, but not with that suffix, failed only
    # once the work was done ("File name too long" of the temporary file, after a whole evaluation)
    try:
        limit = os.pathconf(there, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    suffix = len(os.fsencode(building_suffix()))
    if len(os.fsencode(path.name)) + suffix > limit:
        raise UserError(f"{what} {path}: the file name is too long ({len(os.fsencode(path.name))} bytes; at most "
                        f"{limit - suffix} here, which leaves room for the temporary name it is written under first)")
    return path


# --------------------------------------------------------------------------------------
# Reading: validate before use
# --------------------------------------------------------------------------------------


GIT_LFS_POINTER = b"version https://git-lfs.github.com/spec/"  # how a Git LFS pointer file starts


def refuse_lfs_pointer(path: str | Path, head: bytes | None = None, error: type[UserError] = CheckpointError,
                       what: str = "") -> None:
    """A one-line ``error`` naming the file (``what`` in front: "--data file ") when ``path`` (whose first bytes
    are ``head``, read here when not given) is a Git LFS pointer: the few lines of text that stand for a large
    file a clone without Git LFS did not fetch. A file that cannot be read is left to its reader's error."""
    if head is None:
        try:
            with open(path, "rb") as f:
                head = f.read(len(GIT_LFS_POINTER))
        except OSError:
            return
    if head.startswith(GIT_LFS_POINTER):
        raise error(f"{what}{path} is a Git LFS pointer, not the file itself (cloned without Git LFS): run "
                    f"`git lfs pull` in its repository to fetch it")


MAX_JSON_BYTES = 256 * 2**20  # far above any JSON file gbattn reads (a Llama tokenizer.json: about 9 MiB)
MAX_JSONL_LINE = 2**16  # bytes; a metrics line of gbattn's is about 200
MAX_JSONL_BYTES = 2**30  # far above any metrics.jsonl (every step of a million-step run logged: about 300 MiB)


def refuse_oversized(path: Path, limit: int, kind: str) -> None:
    """A one-line :class:`CheckpointError` for a file larger than ``limit`` bytes (``kind``: what gbattn reads of
    that sort), refused unread: a file linked to a huge one, or a sparse one, would fill the memory."""
    size = path.stat().st_size
    if size > limit:
        raise CheckpointError(f"{path} is {size / 2**20:,.0f} MiB: larger than any {kind} gbattn reads "
                              f"({limit // 2**20} MiB at most); not read")


def read_json_bytes(path: str | Path) -> bytes:
    """The bytes of a JSON file (a config, a tokenizer), or a one-line :class:`CheckpointError` naming it. A file
    larger than :data:`MAX_JSON_BYTES` is refused unread (:func:`refuse_oversized`), a Git LFS pointer as one
    (:func:`refuse_lfs_pointer`)."""
    path = Path(path)
    try:
        refuse_oversized(path, MAX_JSON_BYTES, "JSON file")
        content = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({e.strerror or e})") from None
    refuse_lfs_pointer(path, content)
    return content


def refuse_not_regular(path: Path) -> None:
    """A one-line :class:`CheckpointError` where a file to read is wanted at ``path`` and something else is there: a
    directory, a device or a pipe (never read: /dev/zero never ends, a FIFO waits for a writer), or a link to one.
    Nothing there (a link to nothing too) is left to the reader's own words. Such a file was told as "not found"."""
    if path.is_dir():
        kind = "a directory"
    elif path.exists() and not path.is_file():
        kind = "a device or a pipe"
    else:
        return
    link = f" (a link to {os.readlink(path)})" if path.is_symlink() else ""
    raise CheckpointError(f"{path} is {kind}{link}, not a regular file: put the file itself there")


def read_json(path: str | Path) -> dict:
    """A JSON object from ``path``, or a one-line :class:`CheckpointError` naming the file (read by
    :func:`read_json_bytes`: a huge file is refused unread)."""
    path = Path(path)
    if path.parent.exists() and not path.parent.is_dir():  # a file given for the directory: not "FILE/config.json"
        kind = "a file" if path.parent.is_file() else "a device or a pipe"  # (a FIFO was called "a file")
        raise CheckpointError(f"{path.parent} is {kind}, not a gbattn run directory")
    if not path.is_file():
        refuse_not_regular(path)
        raise CheckpointError(f"{path} not found: is {path.parent} a gbattn run directory?"
                              f"{did_you_mean_path(path.parent)}")  # runs/gab for runs/gba
    content = read_json_bytes(path)
    try:
        obj = json.loads(content.decode("utf-8"))
    except ValueError as e:  # bad JSON or UTF-8, or an integer of more digits than Python converts (4,300)
        raise CheckpointError(f"{path} is not valid JSON ({error_detail(e)})") from None
    except RecursionError:
        raise CheckpointError(f"{path} is not a gbattn file (its JSON is nested too deeply to read)") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds {type(obj).__name__}, expected a JSON object")
    return obj


def did_you_mean_path(path: str | Path, at_most: int = 10_000) -> str:
    """`` (did you mean 'FOLDER/NAME'?)`` for the entry of ``path``'s folder (of its first ``at_most``) whose name
    ``path``'s is a near miss of (``wiki.train.tokens`` where ``wiki.train.tokens.gz`` is, ``runs/gab`` where
    ``runs/gba`` is), else ``""``: compared by name, not by the whole path (which every sibling shares). A path that
    exists is no typo: ``""``; nor is a link to nothing, whose own name is no other entry's."""
    path = Path(path)
    if path.exists():
        return ""
    try:
        with os.scandir(path.parent) as entries:
            others = [entry.name for entry in itertools.islice(entries, at_most) if entry.name != path.name]
            match = near_miss(path.name, others)
    except OSError:  # no such folder, or one that cannot be read
        return ""
    return f" (did you mean {str(path.parent / match)!r}?)" if match else ""


def read_jsonl(path: str | Path) -> list[dict]:
    """The JSON objects of the lines of ``path`` (a metrics.jsonl), [] when it is not a file; a line cut short or
    damaged is skipped. A file larger than :data:`MAX_JSONL_BYTES` is a one-line :class:`CheckpointError`, unread (a
    sparse 20 GiB file filled the memory, then read as "out of memory: choose smaller sizes")."""
    return list(iter_jsonl(path))


def iter_jsonl(path: str | Path) -> Iterator[dict]:
    """:func:`read_jsonl`'s objects one at a time (a file of a million lines is never held whole)."""
    path = Path(path)
    if not path.is_file():
        return
    refuse_oversized(path, MAX_JSONL_BYTES, "metrics file")
    with open(path, "rb") as f:  # a line at a time, none longer than MAX_JSONL_LINE read whole: a sparse file of
        while True:              # zeros under the size limit was read whole, then decoded (2.1 GB for 1 GiB)
            line = f.readline(MAX_JSONL_LINE + 1)
            if not line:
                return
            if len(line) > MAX_JSONL_LINE:  # no record of gbattn's is this long: skip to the line's end
                while line and not line.endswith(b"\n"):
                    line = f.readline(MAX_JSONL_LINE)
                continue
            try:
                record = json.loads(line.decode("utf-8", errors="replace"))
            except (ValueError, RecursionError):  # ValueError: bad JSON, or an integer of more than 4,300 digits
                continue  # a line cut short by a kill, or damaged
            if isinstance(record, dict):
                yield record


def relative_path(path, base) -> str:
    """``path`` as a relative POSIX path for a results file: relative to ``base`` when it lies
    inside it, else its last two parts (``standard/seed42``). Never absolute: results files must
    not hold the paths of the machine that wrote them."""
    path, base = Path(path).resolve(), Path(base).resolve()
    if path != base and path.is_relative_to(base):
        return path.relative_to(base).as_posix()
    parts = path.relative_to(path.anchor).parts
    return Path(*parts[-2:]).as_posix() if parts else "."


def option_path(path: str | os.PathLike) -> str:
    """A path as an option's value: ``./`` before a leading dash (``--out -run`` read ``-run`` as an option)."""
    text = str(path)
    return f"./{text}" if text.startswith("-") else text


def shell_path(path: str | os.PathLike) -> str:
    """A path in a command gbattn suggests, as a shell reads it back and an option takes it: quoted (a space), and
    as :func:`option_path` writes it."""
    return shlex.quote(option_path(path))


def folder_name(path: str | os.PathLike) -> str:
    """A folder's name as given (a link by its own name, not its target's); ``.``, ``..`` and ``dir/..`` by the
    folder they reach (their own names say nothing)."""
    path = Path(path)
    return path.name if path.name not in ("", ".", "..") else path.resolve().name


def portable_path(text: str) -> str:
    """A path for a results file: as given when a name (``tiny-shakespeare``) or a path inside the
    working directory; an absolute path, or one that climbs out (``../data/wikitext-2``), becomes its
    last component, so results files hold no paths of this machine. A file keeps its folder too
    (``/home/me/data/tiny-shakespeare/input.txt`` -> ``tiny-shakespeare/input.txt``): a corpus file's name
    alone does not say which corpus it is, and a comparison tells its recipe's data from other data by it. A path
    from a home directory (``~/data/x.txt``, quoted so the shell left it) is one of this machine's too. A relative path
    is normalised (``./splits/`` -> ``splits``), unless that leaves the name of a corpus gbattn knows
    (``./tiny-shakespeare/`` -> ``./tiny-shakespeare``)."""
    made = _portable_path(text)
    from gbattn.data.corpus import BUNDLED, HF_NAMES  # (files.py is imported by corpus.py: here, not at the top)

    # A folder or file of a corpus's name (`./tiny-shakespeare`, `/data/wikitext-2-v1`) recorded as that bare name
    # would be the corpus gbattn ships or fetches: the same command run again trained on other data.
    return f"./{made}" if made != text and (made in BUNDLED or made in HF_NAMES) else made


def _portable_path(text: str) -> str:
    if text.startswith("~"):
        text = os.path.expanduser(text)
    if not (os.path.isabs(text) or ".." in Path(text).parts):
        # (a trailing slash, as tab completion adds, or ./ : the same folder, which an absolute path reached as
        # "splits" and the same path typed again without the slash did not match)
        return os.path.normpath(text)
    path = Path(text)
    if path.is_file() and path.parent.name not in ("", ".."):
        return f"{path.parent.name}/{path.name}"
    return path.name or text  # the root has no last component: it stays "/" (it says nothing of this machine)
