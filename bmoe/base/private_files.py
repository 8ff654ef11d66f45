"""Whether another local user could change a file or folder bmoe keeps for its user.

A prompt-cache entry (bmoe.generation.prompt_cache) goes to llama.cpp's state loader, and bmoe can
check it only against its own header and hash, which whoever writes the file can make match. So
bmoe takes entries only from a folder that no other user can change, and only entries that no
other user can change. "Another user" means any uid but bmoe's own and root (root can change
anything anyway). A folder or file is changeable by others when another uid owns it, or when its
group or everyone may write to it. A folder with the sticky bit set (like /tmp) is the exception:
others can add files there but cannot rename or remove ours, and what they add is theirs, which
the entry check refuses. Group-writable counts, as in OpenSSH's StrictModes, because nothing says
who is in the group. Every folder on the path counts too: whoever can write one of them can swap
what lies below it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def changeable_by_others(st: os.stat_result) -> str | None:
    """Why a uid other than this process's and root's can change what `st` describes, or None."""
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        return f"is owned by uid {st.st_uid}, not by you (uid {me}) or root"
    sticky = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
    if st.st_mode & 0o022 and not sticky:
        return f"can be written by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def private_folder(folder: Path) -> str | None:
    """Create `folder` if it is missing, and each missing folder above it, with mode 0700; then
    say why it cannot be used (not a folder, or another user could change what is in it: which
    folder on its real path, and the fix), or None."""
    missing = []
    for d in (folder, *folder.parents):
        if d.exists():
            break
        missing.append(d)
    for d in reversed(missing):
        d.mkdir(mode=0o700, exist_ok=True)
    real = folder.resolve()
    if not real.is_dir():
        return f"{real} is not a folder; name a folder (bmoe makes it when it is missing)"
    for d in (real, *real.parents):
        st = d.stat()
        why = changeable_by_others(st)
        if why is None:
            continue
        fix = ("chown it or choose a folder of your own" if st.st_uid not in (os.geteuid(), 0)
               else f"run `chmod go-w {d}` or choose a folder of your own")
        return f"{d} {why}, so another user could swap the files bmoe loads from it; {fix}"
    return None
