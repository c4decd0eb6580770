"""The llama.cpp trees `testbed ab A B backend=llamacpp` measures against each other.

A side is named by one of:

  sdist         the llama.cpp the llama-cpp-python sdist vendors (build.SDIST), the default tree
  a folder      a llama.cpp tree on this host (ggml/include/ggml.h and tests/test-backend-ops.cpp)
  a revision    of a llama.cpp git checkout named by `--repo DIR` (HEAD~2, a branch, a commit): its
                files taken with `git archive` into .cache/llamacpp/ab/rev-TREE/ (TREE: git's tree hash)
  BASE+PATCH    the tree BASE (any of the above) with a patch file applied (`patch -p1`, as `git diff`
                writes them); a patch file alone is `sdist+PATCH`. The patched copy lives in
                .cache/llamacpp/ab/patched-HASH/ (HASH over BASE's source hash and the patch's bytes)

A symbolic link among the files a build reads is refused (exit 2) wherever it comes from: a folder, a
revision (before anything is taken out of git), or one a patch makes (before the patched copy is kept),
as in a kernels/ tree: its bytes would come from outside the tree.

Every folder made here appears whole or not at all (filled beside its final name, then renamed), so an
interrupted or concurrent resolution never leaves half a tree. What is built from a tree is then cached
by the hash of its bytes (build.source_hash): a tree named twice is built once.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from testbed import children
from testbed.backends.llamacpp import build
from testbed.backends.native.build import whole_folder
from testbed.errors import ToolMissing, UsageError

AB_CACHE = build.CACHE / "ab"
SDIST_NAME = "sdist"


@dataclass(frozen=True)
class LlamaTree:
    """One side: what the user named, what it stands for (recorded), and the llama.cpp tree built."""

    spec: str
    revision: str
    source: Path


def is_llamacpp_tree(folder: Path) -> bool:
    return (folder / "ggml" / "include" / "ggml.h").is_file() and (folder / "tests" / "test-backend-ops.cpp").is_file()


def resolve(spec: str, repo: str | None = None, progress: Callable[[str], None] = lambda m: None) -> LlamaTree:
    """The tree `spec` names (see the module's docstring); a bad name is a UsageError saying what is accepted."""
    accepted = ("accepted: sdist, a llama.cpp folder, a revision of the checkout --repo names, BASE+PATCH "
                "or a patch file (applied to the sdist)")
    if spec == SDIST_NAME:
        name, version = build.SDIST
        return LlamaTree(spec, f"sdist:{name}=={version}", build.sdist_source(progress=progress))
    path = Path(spec).expanduser()
    if path.is_dir():
        if not is_llamacpp_tree(path):
            raise UsageError(f"{spec!r} is a folder but not a llama.cpp tree (no ggml/include/ggml.h and "
                             f"tests/test-backend-ops.cpp); {accepted}")
        try:
            build.built_files(path.resolve())  # a symbolic link among what a build reads is refused
        except UsageError as e:
            raise UsageError(f"tree {spec!r}: {e}") from None
        return LlamaTree(spec, f"folder:{path.resolve()}", path.resolve())
    if path.is_file():
        return patched(resolve(SDIST_NAME, repo, progress), path, f"{SDIST_NAME}+{spec}")
    base, plus, patch = spec.rpartition("+")
    if plus and base and Path(patch).expanduser().is_file():
        return patched(resolve(base, repo, progress), Path(patch).expanduser(), spec)
    if plus and base:
        raise UsageError(f"{spec!r}: the patch {patch!r} is not a file; {accepted}")
    if repo is None:
        raise UsageError(f"{spec!r} is neither sdist, a folder nor a patch file, and no llama.cpp checkout is named "
                         f"for it to be a revision of (--repo DIR); {accepted}")
    return revision(spec, Path(repo).expanduser())


def revision(spec: str, repo: Path) -> LlamaTree:
    """The files of revision `spec` of the llama.cpp git checkout `repo`."""
    def git(*args: str, text: bool = True) -> subprocess.CompletedProcess:
        return children.run(["git", "-C", str(repo), *args], capture_output=True, text=text)

    if not repo.is_dir() or git("rev-parse", "--git-dir").returncode != 0:
        raise UsageError(f"--repo {str(repo)!r} is not a git checkout; accepted: the folder of a llama.cpp git clone")
    commit = git("rev-parse", "--verify", "--quiet", f"{spec}^{{commit}}")
    if commit.returncode != 0:
        raise UsageError(f"{spec!r} is not a revision of {repo} (nor sdist, a folder or a patch file); accepted: a "
                         "revision that exists there (HEAD, HEAD~3, a branch, a tag, a commit)")
    sha = commit.stdout.strip()
    links = [line.split("\t", 1)[1] for line in git("ls-tree", "-r", "-z", sha).stdout.split("\0")
             if line.startswith("120000 ")]  # git's mode of a symbolic link
    read = [link for link in links if build.built_path(link)]
    if read:
        raise UsageError(f"revision {spec!r} ({sha[:12]}) of {repo}: {read[0]} is a symbolic link; accepted: a "
                         "llama.cpp tree of plain files and folders (a link's bytes would come from outside the tree)")
    tree = git("rev-parse", f"{sha}^{{tree}}").stdout.strip()
    out = AB_CACHE / f"rev-{tree[:16]}"
    if not out.is_dir():
        def fill(tmp: Path) -> None:
            archive = git("archive", "--format=tar", sha, text=False)
            if archive.returncode != 0:
                raise UsageError(f"git archive of {spec!r} ({sha[:12]}) in {repo} failed: "
                                 f"{archive.stderr.decode(errors='replace').strip()}")
            with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
                tar.extractall(tmp, filter="data")  # no links or paths out of the folder
        whole_folder(out, fill)
    if not is_llamacpp_tree(out):
        raise UsageError(f"revision {spec!r} ({sha[:12]}) of {repo} is not a llama.cpp tree (no ggml/include/ggml.h "
                         "and tests/test-backend-ops.cpp)")
    return LlamaTree(spec, f"git:{sha}", out)


def patched(base: LlamaTree, patch: Path, spec: str) -> LlamaTree:
    """`base` with `patch` applied, in a copy of the files a build reads; a patch that does not apply
    is refused with patch's own message, and nothing is left behind."""
    if shutil.which("patch") is None:
        raise ToolMissing("`patch` is not installed (Debian: apt-get install patch)")
    text = patch.read_bytes()
    digest = hashlib.sha256(build.source_hash(base.source).encode() + b"\0" + text).hexdigest()
    out = AB_CACHE / f"patched-{digest[:16]}"
    if not out.is_dir():
        def fill(tmp: Path) -> None:
            for source in build.built_files(base.source):
                copy = tmp / source.relative_to(base.source)
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, copy)
            # --batch: never ask; rejects go nowhere (the folder is thrown away when a hunk fails)
            p = children.run(["patch", "-p1", "--batch", "--forward", "--no-backup-if-mismatch", "-r", "-",
                              "-d", str(tmp), "-i", str(patch.resolve())], capture_output=True, text=True)
            if p.returncode != 0:
                said = [line.strip() for line in (p.stdout + p.stderr).splitlines()
                        if line.strip() and not line.startswith(("patching file", "checking file"))]
                raise UsageError(f"patch {str(patch)!r} does not apply to {base.spec}: "
                                 f"{'; '.join(said[:3]) or f'patch exited {p.returncode}'}")
            try:  # a git patch can make a symbolic link: refused as in any tree (and nothing is kept)
                build.built_files(tmp)
            except UsageError as e:
                raise UsageError(f"patch {str(patch)!r} on {base.spec}: {e}") from None
        whole_folder(out, fill)
    return LlamaTree(spec, f"{base.revision}+patch:{hashlib.sha256(text).hexdigest()[:16]}", out)
