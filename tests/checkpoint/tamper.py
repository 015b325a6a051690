"""Damage and attacks on a saved checkpoint, as a disk or a person with write access would do them."""

import json
import os
import pickle
from pathlib import Path

import xxhash
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex


def block_digests(file: Path) -> list[str]:
    """The XXH3-128 of each 16 MiB of ``file``, as COMMITTED records them."""
    data = file.read_bytes()
    return [xxhash.xxh3_128(data[i : i + 2**24]).hexdigest() for i in range(0, max(len(data), 1), 2**24)]


def recommit(path: Path) -> None:
    """Rewrite COMMITTED to match the files as they are now: an attacker controls every file, the marker included."""
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name != "COMMITTED")
    listing = {"files": {p.name: p.stat().st_size for p in files}, "digest": "xxh3_128", "blocks": {p.name: block_digests(p) for p in files}}
    (path / "COMMITTED").write_text(json.dumps(listing))


def flip(file: Path, count: int = 16, at: int | None = None) -> None:
    """Invert ``count`` bytes from ``at`` (None: the middle; negative: from the end) of ``file``; its size stays the same."""
    data = bytearray(file.read_bytes())
    start = len(data) // 2 if at is None else at % len(data)
    data[start : start + count] = bytes(b ^ 0xFF for b in data[start : start + count])
    file.write_bytes(bytes(data))


class Payload:
    """A pickle that creates ``marker`` when it is loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def index(path: Path):
    with open(path / ".metadata", "rb") as file:
        return pickle.load(file)  # the test's own checkpoint, before it is tampered with


def write_index(path: Path, metadata) -> None:
    with open(path / ".metadata", "wb") as file:
        pickle.dump(metadata, file)


def bytes_entry(path: Path, key: str, marker: Path, file: str = "payload.bin") -> None:
    """Make ``key`` a bytes entry (of allow-listed classes only) that passes a ``hasattr(entry, "size")``
    check, its storage a malicious pickle in ``file``; then recommit."""
    evil = pickle.dumps(Payload(marker))
    if "/" not in file:
        (path / file).write_bytes(evil)
    metadata = index(path)
    tensor = metadata.state_dict_metadata[key]
    entry = BytesStorageMetadata()
    entry.size, entry.properties = tensor.size, tensor.properties
    metadata.state_dict_metadata[key] = entry
    metadata.storage_data = {i: s for i, s in metadata.storage_data.items() if i.fqn != key}
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo(file, 0, len(evil))
    write_index(path, metadata)
    recommit(path)
