"""The rotation zoo: ready-made rotation files, listed with their sha256 in ``index.json``.

Layout of a zoo directory (the repository's ``rotation_zoo/``, or a Hugging Face model repo
with the same files, or a local download of one)::

    index.json     {"format_version": 1, "entries": [{model, recipe, group_size, file,
                    sha256, size, metrics, command, ...}, ...]}
    <file>.safetensors ...

``pull`` downloads ``index.json`` and then the chosen file from a Hugging Face repo with
``huggingface_hub`` (``endpoint`` may point at a mirror), and refuses the file unless its sha256
matches the index and it loads as a valid rotation file.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..common import settings
from ..common.rotations import RotationFileError, RotationSet, _same_model, load_rotation_file, sha256_file

INDEX_NAME = "index.json"
# Hugging Face repo the zoo is published to (override with --repo or OSCAR_SGLANG_ZOO_REPO).
DEFAULT_REPO = settings.ZOO_REPO.get()


class ZooError(RuntimeError):
    """Zoo lookup / download / verification failure; the message says what to do."""




def default_zoo_dir() -> Path:
    """$OSCAR_SGLANG_ZOO_DIR, else the source tree's rotation_zoo/ (editable installs), else
    the download cache ~/.cache/oscar-sglang/zoo."""
    env = settings.ZOO_DIR.get()
    if env:
        return Path(env)
    repo_zoo = Path(__file__).resolve().parents[2] / "rotation_zoo"  # oscar_sglang/tools/zoo.py
    if (repo_zoo / INDEX_NAME).is_file():
        return repo_zoo
    from ..common.embedded import cache_dir

    return cache_dir() / "zoo"


def read_index(zoo_dir=None) -> dict:
    zoo_dir = Path(zoo_dir or default_zoo_dir())
    path = zoo_dir / INDEX_NAME
    if not path.is_file():
        raise ZooError(f"no zoo index at {path}; run `oscar-sglang zoo pull <model>` or pass --zoo DIR")
    try:
        index = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ZooError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(index.get("entries"), list):
        raise ZooError(f"{path} has no 'entries' list")
    return index


def write_index(index: dict, zoo_dir) -> None:
    path = Path(zoo_dir) / INDEX_NAME
    path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def entry_for_file(path, **extra) -> dict:
    """An index entry describing a rotation file (reads its metadata)."""
    rs = load_rotation_file(path)
    md = rs.metadata
    entry = {
        "model": md.get("model_id"),
        "recipe": rs.recipe,
        "group_size": md.get("group_size"),
        "per_head": bool(md.get("per_head", False)),
        "num_layers": rs.num_layers,
        "head_dim": rs.head_dim,
        "file": Path(path).name,
        "sha256": rs.sha256,
        "size": Path(path).stat().st_size,
        "metrics": md.get("metrics", {}).get("heldout_rel_attn_err_mean", {}),
    }
    entry.update(extra)
    return entry


def add_to_index(path, zoo_dir, **extra) -> dict:
    """Add (or replace: same file name) the entry of `path` in zoo_dir/index.json."""
    zoo_dir = Path(zoo_dir)
    try:
        index = read_index(zoo_dir)
    except ZooError:
        index = {"format_version": 1, "entries": []}
    entry = entry_for_file(path, **extra)
    index["entries"] = [e for e in index["entries"] if e.get("file") != entry["file"]] + [entry]
    write_index(index, zoo_dir)
    return entry


def find_entries(index: dict, model: str | None = None, recipe: str | None = None) -> list[dict]:
    out = []
    for e in index["entries"]:
        if model and not (_same_model(model, e.get("model") or "") or model == e.get("file")):
            continue
        if recipe and e.get("recipe") != recipe:
            continue
        out.append(e)
    return out


def verify_entry(entry: dict, zoo_dir) -> tuple[bool, str]:
    """(ok, message): file present, sha256 as indexed, loads and passes the rotation checks."""
    path = Path(zoo_dir) / entry["file"]
    if not path.is_file():
        return False, f"{entry['file']}: MISSING (run `oscar-sglang zoo pull {entry.get('model')}`)"
    digest = sha256_file(path)
    if digest != entry["sha256"]:
        return False, (
            f"{entry['file']}: SHA256 MISMATCH (index {entry['sha256'][:16]}..., file "
            f"{digest[:16]}...): the file was modified or corrupted; do not use it, pull it again"
        )
    try:
        load_rotation_file(path)
    except RotationFileError as e:
        return False, f"{entry['file']}: INVALID ({e})"
    return True, f"{entry['file']}: OK (sha256 {digest[:16]}...)"


def resolve(model: str, recipe: str = "oscar", zoo_dir=None) -> RotationSet:
    """The verified zoo RotationSet for `model` (raises ZooError if absent or tampered)."""
    zoo_dir = Path(zoo_dir or default_zoo_dir())
    entries = find_entries(read_index(zoo_dir), model, recipe)
    if not entries:
        raise ZooError(f"the zoo at {zoo_dir} has no {recipe!r} rotation for {model!r}; see `oscar-sglang zoo list`")
    ok, msg = verify_entry(entries[0], zoo_dir)
    if not ok:
        raise ZooError(msg)
    return load_rotation_file(Path(zoo_dir) / entries[0]["file"])


def pull(model: str, recipe: str = "oscar", repo: str | None = None, revision: str | None = None,
         endpoint: str | None = None, dest=None, cache_dir=None) -> list[Path]:
    """Download the index and the matching file(s) from a Hugging Face repo into `dest`
    (default: the cache zoo), verify sha256 and validity, merge the entries into dest's index."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as e:
        raise ZooError("`zoo pull` needs huggingface_hub: pip install 'oscar-sglang[calib]'") from e
    repo = repo or DEFAULT_REPO
    dest = Path(dest) if dest else _cache_zoo()
    dest.mkdir(parents=True, exist_ok=True)
    kw = dict(repo_id=repo, revision=revision, endpoint=endpoint,
              cache_dir=str(cache_dir) if cache_dir else None)
    try:
        remote_index = json.loads(Path(hf_hub_download(filename=INDEX_NAME, **kw)).read_text())
    except Exception as e:  # network, auth, missing repo: all end here
        raise ZooError(f"cannot fetch {INDEX_NAME} from Hugging Face repo {repo!r}"
                       f"{' at ' + endpoint if endpoint else ''}: {e}") from e
    entries = find_entries(remote_index, model, recipe)
    if not entries:
        have = sorted({f"{e.get('model')} ({e.get('recipe')})" for e in remote_index.get("entries", [])})
        raise ZooError(f"repo {repo!r} has no {recipe!r} rotation for {model!r}; it has: {have}")
    got = []
    for entry in entries:
        try:
            cached = Path(hf_hub_download(filename=entry["file"], **kw))
        except Exception as e:
            raise ZooError(f"cannot download {entry['file']} from {repo!r}: {e}") from e
        digest = sha256_file(cached)
        if digest != entry["sha256"]:
            raise ZooError(
                f"{entry['file']} from {repo!r} has sha256 {digest}, the index says "
                f"{entry['sha256']}: refusing it (tampered or corrupted download)"
            )
        target = dest / entry["file"]
        tmp = target.with_suffix(target.suffix + ".part")
        tmp.write_bytes(cached.read_bytes())
        tmp.replace(target)
        ok, msg = verify_entry(entry, dest)
        if not ok:
            target.unlink(missing_ok=True)
            raise ZooError(msg)
        try:
            index = read_index(dest)
        except ZooError:
            index = {"format_version": 1, "entries": []}
        index["entries"] = [e for e in index["entries"] if e.get("file") != entry["file"]] + [entry]
        write_index(index, dest)
        got.append(target)
    return got


def _cache_zoo() -> Path:
    from ..common.embedded import cache_dir

    return cache_dir() / "zoo"
